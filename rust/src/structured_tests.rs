use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::*;

/// EOS of the test vocabulary.
const EOS: TokenId = 0;
/// A special token: no text.
const SPECIAL: TokenId = 1;
/// Logits width: 5 padding ids past the vocabulary.
const NUM_PADDING: usize = 5;

/// A tiny vocabulary: EOS, a special token, every printable ASCII byte, and multi-byte
/// tokens that overlap them (so one text has many tokenizations).
fn vocabulary() -> Vec<Vec<u8>> {
    let mut tokens: Vec<Vec<u8>> = vec![b"<|eos|>".to_vec(), Vec::new()];
    tokens.extend((0x20u8..=0x7e).map(|byte| vec![byte]));
    for text in
        ["{\"", "\":", "\",\"", "true", "false", "null", "yes", "no", "ab", "abc", "12", "é"]
    {
        tokens.push(text.as_bytes().to_vec());
    }
    tokens
}

fn matchers() -> GrammarMatchers {
    let tokens = vocabulary();
    let vocab_size = tokens.len() + NUM_PADDING;
    GrammarMatchers::new(tokens, EOS, vocab_size).unwrap()
}

fn token_of(text: &str) -> TokenId {
    vocabulary().iter().position(|bytes| bytes == text.as_bytes()).unwrap() as TokenId
}

fn allowed(m: &mut GrammarMatchers, handle: MatcherHandle) -> Vec<TokenId> {
    let mut bitmask = vec![0; m.num_mask_words()];
    m.fill_bitmask(&[handle], &mut bitmask).unwrap();
    (0..m.vocab_size() as TokenId)
        .filter(|&token| bitmask[token as usize / 32] & (1 << (token % 32)) != 0)
        .collect()
}

/// Feeds `text` one byte token at a time; each must be accepted.
fn feed(m: &mut GrammarMatchers, handle: MatcherHandle, text: &str) {
    for byte in text.bytes() {
        let token = token_of(std::str::from_utf8(&[byte]).unwrap());
        assert!(m.advance(handle, token).unwrap(), "{:?} refused in {text:?}", byte as char);
    }
}

fn start(m: &mut GrammarMatchers, kind: GrammarKind, spec: &str) -> MatcherHandle {
    let grammar = m.compile(kind, spec).unwrap();
    m.add(grammar).unwrap()
}

fn texts(tokens: &[TokenId]) -> Vec<String> {
    let vocabulary = vocabulary();
    tokens.iter().map(|&t| String::from_utf8_lossy(&vocabulary[t as usize]).into_owned()).collect()
}

fn invalid_message(m: &mut GrammarMatchers, kind: GrammarKind, spec: &str) -> String {
    match m.compile(kind, spec) {
        Err(Error::InvalidArgument(message)) => message,
        other => panic!("{kind:?} {spec:?} compiled: {other:?}"),
    }
}

#[test]
fn choice_allows_exactly_the_choices_then_only_eos() {
    let mut m = matchers();
    let handle = start(&mut m, GrammarKind::Choice, r#"["yes", "no"]"#);
    let mut first = texts(&allowed(&mut m, handle));
    first.sort();
    assert_eq!(first, ["n", "no", "y", "yes"]);
    assert!(m.advance(handle, token_of("yes")).unwrap());
    assert!(m.is_finished(handle).unwrap());
    assert_eq!(allowed(&mut m, handle), [EOS]);
    assert!(m.advance(handle, EOS).unwrap());
    assert!(!m.advance(handle, token_of("y")).unwrap());
}

#[test]
fn choices_may_hold_quotes_backslashes_and_the_empty_string() {
    let mut m = matchers();
    let handle = start(&mut m, GrammarKind::Choice, r#"["", "a\"b\\", "|"]"#);
    assert!(allowed(&mut m, handle).contains(&EOS));
    feed(&mut m, handle, "a\"b\\");
    assert!(m.is_finished(handle).unwrap());
}

#[test]
fn eos_is_allowed_only_where_the_text_may_end() {
    let mut m = matchers();
    let handle = start(&mut m, GrammarKind::Regex, "[0-9]+(ab)?");
    assert!(!allowed(&mut m, handle).contains(&EOS));
    assert!(!m.advance(handle, EOS).unwrap());
    feed(&mut m, handle, "7");
    assert!(allowed(&mut m, handle).contains(&EOS));
    assert!(!m.is_finished(handle).unwrap());
    feed(&mut m, handle, "a");
    assert_eq!(allowed(&mut m, handle), [token_of("b")]);
    feed(&mut m, handle, "b");
    assert!(m.is_finished(handle).unwrap());
    assert_eq!(allowed(&mut m, handle), [EOS]);
}

#[test]
fn refused_token_leaves_the_state_as_it_was() {
    let mut m = matchers();
    let handle = start(&mut m, GrammarKind::Regex, "[0-9]{2}");
    feed(&mut m, handle, "1");
    let before = allowed(&mut m, handle);
    assert!(!m.advance(handle, token_of("a")).unwrap());
    assert!(!m.advance(handle, token_of("12")).unwrap());
    assert_eq!(allowed(&mut m, handle), before);
    feed(&mut m, handle, "2");
    assert!(m.is_finished(handle).unwrap());
}

#[test]
fn special_and_padding_ids_are_never_allowed() {
    let mut m = matchers();
    let handle = start(&mut m, GrammarKind::Grammar, "start: /[^x]*/");
    let first = allowed(&mut m, handle);
    let vocab_size = vocabulary().len() as TokenId;
    assert!(!first.contains(&SPECIAL));
    assert!(first.iter().all(|&token| token < vocab_size));
    assert!(first.contains(&token_of("é")) && !first.contains(&token_of("x")));
    assert!(!m.advance(handle, SPECIAL).unwrap());
    assert!(!m.advance(handle, vocab_size + 1).unwrap());
    assert!(matches!(m.advance(handle, vocab_size + 5), Err(Error::InvalidArgument(_))));
}

#[test]
fn json_output_is_compact() {
    let mut m = matchers();
    let schema = r#"{"type": "object", "properties": {"a": {"type": "boolean"}},
                     "required": ["a"], "additionalProperties": false}"#;
    let handle = start(&mut m, GrammarKind::JsonSchema, schema);
    for piece in ["{", "\"", "a", "\"", ":", "t", "r", "u", "e", "}"] {
        assert!(!allowed(&mut m, handle).contains(&token_of(" ")), "space allowed before {piece}");
        feed(&mut m, handle, piece);
    }
    assert!(m.is_finished(handle).unwrap());
}

#[test]
fn compile_is_cached_by_kind_and_spec() {
    let mut m = matchers();
    let first = m.compile(GrammarKind::Regex, "[ab]+").unwrap();
    assert_eq!(m.compile(GrammarKind::Regex, "[ab]+").unwrap(), first);
    assert_ne!(m.compile(GrammarKind::Grammar, "start: /[ab]+/").unwrap(), first);
    assert_eq!(
        m.compile(GrammarKind::JsonObject, "").unwrap(),
        m.compile(GrammarKind::JsonObject, "ignored").unwrap()
    );
    let stats = m.stats();
    assert_eq!((stats.num_compiled, stats.cache_hits), (3, 2));
    assert!(stats.compile_seconds_total > 0.0);
}

#[test]
fn least_recently_used_grammar_is_evicted() {
    let mut m = matchers().with_max_cached_grammars(2).unwrap();
    let a = m.compile(GrammarKind::Regex, "a").unwrap();
    let b = m.compile(GrammarKind::Regex, "b").unwrap();
    m.add(a).unwrap();
    let handle = m.add(b).unwrap();
    m.compile(GrammarKind::Regex, "c").unwrap();
    assert_eq!(m.num_cached_grammars(), 2);
    assert_eq!(m.add(a), Err(Error::UnknownGrammar(a.0)));
    m.add(b).unwrap();
    // Matchers outlive their grammar's eviction.
    feed(&mut m, handle, "b");
    assert!(m.is_finished(handle).unwrap());
    assert_ne!(m.compile(GrammarKind::Regex, "a").unwrap(), a);
}

#[test]
fn invalid_specs_are_refused_with_the_reason() {
    let mut m = matchers();
    let unsupported = r#"{"type": "array", "uniqueItems": true}"#;
    for (kind, spec, expected) in [
        (GrammarKind::JsonSchema, unsupported, "uniqueItems"),
        (GrammarKind::JsonSchema, "{\"type\": ", "not JSON"),
        (GrammarKind::JsonSchema, "[1]", "must be a JSON object"),
        (GrammarKind::JsonSchema, r#"{"type": "strin"}"#, "strin"),
        (GrammarKind::Regex, "(ab", "regex"),
        (GrammarKind::Grammar, "start: foo", "foo"),
        (GrammarKind::Grammar, "root ::= \"a\"", "GBNF"),
        (GrammarKind::Choice, "[]", "empty"),
        (GrammarKind::Choice, r#"{"a": 1}"#, "list of strings"),
        // No token of the vocabulary can start this text.
        (GrammarKind::Regex, "ü", "no token"),
    ] {
        let message = invalid_message(&mut m, kind, spec);
        assert!(message.contains(expected), "{spec:?}: {message}");
    }
    assert!(matches!(GrammarKind::parse("lark"), Err(Error::InvalidArgument(_))));
    assert_eq!(m.stats().num_compiled, 0);
}

#[test]
fn misused_handles_are_errors() {
    let mut m = matchers();
    let handle = start(&mut m, GrammarKind::Regex, "a+");
    let words = m.num_mask_words();
    let mut two_rows = vec![0; 2 * words];
    let err = m.fill_bitmask(&[handle, handle], &mut two_rows);
    assert!(matches!(err, Err(Error::InvalidArgument(_))));
    let unknown = MatcherHandle(handle.0 + 1);
    assert_eq!(
        m.fill_bitmask(&[handle, unknown], &mut two_rows),
        Err(Error::UnknownMatcher(unknown.0))
    );
    let err = m.fill_bitmask(&[handle], &mut two_rows);
    assert!(matches!(err, Err(Error::InvalidArgument(_))));
    m.remove(handle).unwrap();
    assert_eq!(m.remove(handle), Err(Error::UnknownMatcher(handle.0)));
    assert_eq!(m.advance(handle, EOS), Err(Error::UnknownMatcher(handle.0)));
    assert!(m.is_empty());
}

#[test]
fn bad_vocabularies_are_refused() {
    let tokens = vocabulary();
    let n = tokens.len();
    for (eos, vocab_size) in [(0, 0), (0, n - 1), (n as TokenId, n), (0, MAX_VOCAB_SIZE + 1)] {
        let built = GrammarMatchers::new(tokens.clone(), eos, vocab_size);
        assert!(matches!(built, Err(Error::InvalidArgument(_))), "eos {eos}, vocab {vocab_size}");
    }
    let mut long = tokens;
    long.push(vec![b'a'; MAX_TOKEN_BYTES + 1]);
    assert!(GrammarMatchers::new(long, 0, n + 1).is_err());
}

/// A random walk over a grammar: random allowed tokens, EOS (when allowed) with
/// probability 1/4, until the matcher finishes or `max_steps` pass. Every allowed token
/// must be accepted. Returns the text and whether it ended.
fn random_walk(
    m: &mut GrammarMatchers,
    handle: MatcherHandle,
    rng: &mut SmallRng,
) -> (String, bool) {
    let vocabulary = vocabulary();
    let mut text = Vec::new();
    for _ in 0..200 {
        let choices = allowed(m, handle);
        assert!(!choices.is_empty());
        let token = if choices.contains(&EOS) && (choices.len() == 1 || rng.gen_bool(0.25)) {
            EOS
        } else {
            let non_eos: Vec<_> = choices.iter().copied().filter(|&t| t != EOS).collect();
            non_eos[rng.gen_range(0..non_eos.len())]
        };
        assert!(m.advance(handle, token).unwrap(), "allowed token {token} refused");
        if token == EOS {
            assert!(m.is_finished(handle).unwrap());
            return (String::from_utf8(text).unwrap(), true);
        }
        text.extend_from_slice(&vocabulary[token as usize]);
    }
    (String::from_utf8(text).unwrap(), false)
}

#[test]
fn random_walks_stay_inside_their_grammar() {
    let mut m = matchers();
    let mut rng = SmallRng::seed_from_u64(14);
    let schema = r#"{"type": "object", "properties": {
        "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tag": {"enum": ["yes", "no"]}}, "required": ["ok", "n", "tag"],
        "additionalProperties": false}"#;
    let mut num_ended = 0;
    for _ in 0..40 {
        let handle = start(&mut m, GrammarKind::Choice, r#"["yes", "no", "abc", "ab"]"#);
        let (text, ended) = random_walk(&mut m, handle, &mut rng);
        assert!(["yes", "no", "abc", "ab"].contains(&text.as_str()), "{text:?}");
        assert!(ended);

        let handle = start(&mut m, GrammarKind::Regex, "[0-9]{1,3}(ab|é)?");
        let (text, ended) = random_walk(&mut m, handle, &mut rng);
        let digits = text.trim_end_matches("ab").trim_end_matches('é');
        assert!((1..=3).contains(&digits.len()) && digits.bytes().all(|b| b.is_ascii_digit()));
        assert!(ended);

        let handle = start(&mut m, GrammarKind::JsonSchema, schema);
        let (text, ended) = random_walk(&mut m, handle, &mut rng);
        if ended {
            num_ended += 1;
            let value: Value = serde_json::from_str(&text).unwrap();
            assert_eq!(value.as_object().unwrap().len(), 3, "{text}");
            assert!(value["ok"].is_boolean() && value["n"].as_u64().unwrap() <= 99, "{text}");
            assert!(["yes", "no"].contains(&value["tag"].as_str().unwrap()), "{text}");
            assert!(!text.contains(' '), "{text}");
        }
    }
    assert!(num_ended > 0);
}

#[test]
fn filling_many_rows_at_once_equals_filling_them_one_by_one() {
    let mut m = matchers();
    let mut rng = SmallRng::seed_from_u64(7);
    let specs = [
        (GrammarKind::JsonObject, ""),
        (GrammarKind::Regex, "[a-c]+[0-9]*"),
        (GrammarKind::Grammar, "start: item (\",\" item)*\nitem: /[a-z]+/ | \"null\""),
    ];
    let handles: Vec<MatcherHandle> = (0..32)
        .map(|i| {
            let (kind, spec) = specs[i % specs.len()];
            start(&mut m, kind, spec)
        })
        .collect();
    for _ in 0..10 {
        let words = m.num_mask_words();
        let mut together = vec![0; handles.len() * words];
        m.fill_bitmask(&handles, &mut together).unwrap();
        for (row, &handle) in handles.iter().enumerate() {
            let mut alone = vec![0; words];
            m.fill_bitmask(&[handle], &mut alone).unwrap();
            assert_eq!(&together[row * words..(row + 1) * words], alone.as_slice());
        }
        for &handle in &handles {
            if m.is_finished(handle).unwrap() {
                continue;
            }
            let choices: Vec<_> =
                allowed(&mut m, handle).into_iter().filter(|&t| t != EOS).collect();
            if !choices.is_empty() {
                assert!(m.advance(handle, choices[rng.gen_range(0..choices.len())]).unwrap());
            }
        }
    }
    assert!(m.stats().num_masks >= 10 * 2 * 32);
}
