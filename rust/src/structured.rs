//! Structured outputs: per-sequence token masks that keep a sequence inside a grammar (a JSON
//! schema, any JSON object, a regex, one of a list of choices, or a Lark grammar).
//!
//! Built on `llguidance`. One `GrammarMatchers` serves an engine: it holds the vocabulary (a
//! trie over the bytes each token stands for), a cache of compiled grammars keyed by
//! (kind, spec), and one *matcher* (a sequence's position in its grammar) per constrained
//! sequence. Each step the engine fills the masks of its constrained sequences
//! (`fill_bitmask`, in parallel, while the forward pass runs), samples under them and feeds
//! every sampled token back (`advance`).
//!
//! The mask is the int32 bitmask vLLM and xgrammar use:
//!
//! ```text
//!   bitmask[row][w] bit j set  <=>  token 32*w + j may be sampled next by handles[row]
//!   words per row: ceil(vocab_size / 32); bits at or past vocab_size stay 0
//! ```
//!
//! End of sequence: EOS is allowed whenever the text so far is complete (the matcher is
//! accepting). Once nothing but the end can follow, or the matcher failed (a grammar past
//! llguidance's limits), EOS is the only allowed token and `advance(EOS)` is accepted.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Instant;

use llguidance::api::{StopReason, TopLevelGrammar};
use llguidance::toktrie::{ApproximateTokEnv, TokRxInfo, TokTrie, TokenId};
use llguidance::{JsonCompileOptions, Matcher, ParserFactory};
use rayon::prelude::*;
use serde_json::{json, Value};

use crate::error::{Error, Result};

/// Largest vocabulary the token trie can index (its nodes keep subtree sizes in 22 bits).
pub const MAX_VOCAB_SIZE: usize = 1 << 21;
/// Longest token, in bytes, the token trie can hold.
pub const MAX_TOKEN_BYTES: usize = 1024;
/// Compiled grammars kept by default; the least recently used is dropped past this.
pub const DEFAULT_MAX_CACHED_GRAMMARS: usize = 256;

/// A compiled grammar in the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GrammarId(pub u64);

/// One constrained sequence's matcher.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MatcherHandle(pub u64);

/// What a grammar spec is written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GrammarKind {
    /// A JSON schema (the spec is its JSON text).
    JsonSchema,
    /// Any JSON object (the spec is ignored).
    JsonObject,
    /// A regular expression (Rust `regex` syntax, Unicode classes, matched in full).
    Regex,
    /// Exactly one of a JSON list of strings.
    Choice,
    /// A Lark grammar as llguidance reads it.
    Grammar,
}

impl GrammarKind {
    /// Every kind, in the order the docs list them.
    pub const ALL: [GrammarKind; 5] = [
        GrammarKind::JsonSchema,
        GrammarKind::JsonObject,
        GrammarKind::Regex,
        GrammarKind::Choice,
        GrammarKind::Grammar,
    ];

    /// The kind's name in the Python API.
    pub fn as_str(self) -> &'static str {
        match self {
            GrammarKind::JsonSchema => "json_schema",
            GrammarKind::JsonObject => "json_object",
            GrammarKind::Regex => "regex",
            GrammarKind::Choice => "choice",
            GrammarKind::Grammar => "grammar",
        }
    }

    /// Parses a kind name; anything else is an `InvalidArgument` listing the names.
    pub fn parse(name: &str) -> Result<Self> {
        Self::ALL.into_iter().find(|kind| kind.as_str() == name).ok_or_else(|| {
            let names = Self::ALL.map(|kind| format!("{:?}", kind.as_str())).join(", ");
            Error::InvalidArgument(format!("grammar kind must be one of {names}, got {name:?}"))
        })
    }
}

/// Counters of the grammar cache and the mask work.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StructuredStats {
    /// Grammars compiled (cache misses that compiled).
    pub num_compiled: u64,
    /// `compile` calls answered from the cache.
    pub cache_hits: u64,
    /// Wall-clock seconds spent compiling, failed compiles included.
    pub compile_seconds_total: f64,
    /// Wall-clock seconds spent in `fill_bitmask` (all rows of a call together).
    pub mask_seconds_total: f64,
    /// Mask rows filled.
    pub num_masks: u64,
}

/// A compiled grammar: a fresh matcher every new sequence copies.
struct CachedGrammar {
    /// The cache key it was compiled from.
    key: (GrammarKind, String),
    /// A matcher at the start of the grammar, its first mask already computed.
    template: Matcher,
    /// `use_clock` at its last compile or add (least recently used is evicted first).
    last_used: u64,
}

/// Structured-output state of every constrained sequence of an engine.
pub struct GrammarMatchers {
    /// Compiles grammars against the vocabulary's token trie.
    factory: ParserFactory,
    /// The model's logits width (token ids are below it).
    vocab_size: usize,
    /// The end-of-sequence token.
    eos_token_id: TokenId,
    /// Most compiled grammars kept.
    max_cached_grammars: usize,
    /// Cache key to its compiled grammar.
    key_to_grammar_id: HashMap<(GrammarKind, String), GrammarId>,
    /// Compiled grammars by id.
    grammars: HashMap<GrammarId, CachedGrammar>,
    /// Id of the next compiled grammar.
    next_grammar_id: u64,
    /// Ticks on every cache use; orders cached grammars by recency.
    use_clock: u64,
    /// Live matchers by handle.
    handle_to_matcher: HashMap<MatcherHandle, Matcher>,
    /// Handle of the next matcher.
    next_handle: u64,
    /// Counters.
    stats: StructuredStats,
}

impl GrammarMatchers {
    /// Builds the token trie of a vocabulary. `token_bytes[i]` is the text token `i` stands
    /// for; an empty entry (special tokens, and ids from `token_bytes.len()` up to
    /// `vocab_size`, the model's padding) is never allowed. EOS never stands for text,
    /// whatever its entry says: it is allowed only where the grammar may end.
    pub fn new(token_bytes: Vec<Vec<u8>>, eos_token_id: u32, vocab_size: usize) -> Result<Self> {
        if vocab_size == 0 || vocab_size > MAX_VOCAB_SIZE {
            return Err(Error::InvalidArgument(format!(
                "vocab_size must be in [1, {MAX_VOCAB_SIZE}], got {vocab_size}"
            )));
        }
        if token_bytes.len() > vocab_size {
            return Err(Error::InvalidArgument(format!(
                "token_bytes has {} entries, more than vocab_size {vocab_size}",
                token_bytes.len()
            )));
        }
        if eos_token_id as usize >= vocab_size {
            return Err(Error::InvalidArgument(format!(
                "eos_token_id {eos_token_id} is not below vocab_size {vocab_size}"
            )));
        }
        if let Some(token_id) = token_bytes.iter().position(|bytes| bytes.len() > MAX_TOKEN_BYTES) {
            return Err(Error::InvalidArgument(format!(
                "token {token_id} is longer than {MAX_TOKEN_BYTES} bytes"
            )));
        }
        let mut words = token_bytes;
        words.resize(vocab_size, Vec::new());
        words[eos_token_id as usize].clear();
        let info = TokRxInfo::new(vocab_size as u32, eos_token_id);
        // NOTE: the trie asserts its own limits; the checks above should leave none to hit,
        // but a panic here must become an error, not a crash of the server.
        let trie = catch_unwind(AssertUnwindSafe(|| TokTrie::from(&info, &words)))
            .map_err(|_| Error::InvalidArgument("llguidance rejected the vocabulary".into()))?;
        // NOTE: `ApproximateTokEnv` says the tokenization is not canonical (we cannot
        // tokenize here as the model's tokenizer would), so llguidance never forces one
        // token for bytes the grammar fixes: it allows every token consistent with them.
        let tok_env = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&(tok_env as _))
            .map_err(|err| Error::InvalidArgument(format!("llguidance: {err}")))?;
        // Errors go to the caller, not to stderr; and they carry no grammar dump.
        factory.quiet();
        factory.limits_mut().verbose_errors = false;
        Ok(GrammarMatchers {
            factory,
            vocab_size,
            eos_token_id,
            max_cached_grammars: DEFAULT_MAX_CACHED_GRAMMARS,
            key_to_grammar_id: HashMap::new(),
            grammars: HashMap::new(),
            next_grammar_id: 0,
            use_clock: 0,
            handle_to_matcher: HashMap::new(),
            next_handle: 0,
            stats: StructuredStats::default(),
        })
    }

    /// Keeps at most `max_cached_grammars` compiled grammars (at least 1).
    pub fn with_max_cached_grammars(mut self, max_cached_grammars: usize) -> Result<Self> {
        if max_cached_grammars == 0 {
            return Err(Error::InvalidArgument("max_cached_grammars must be >= 1, got 0".into()));
        }
        self.max_cached_grammars = max_cached_grammars;
        Ok(self)
    }

    /// The model's logits width.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The end-of-sequence token.
    pub fn eos_token_id(&self) -> TokenId {
        self.eos_token_id
    }

    /// 32-bit words in one mask row.
    pub fn num_mask_words(&self) -> usize {
        self.vocab_size.div_ceil(32)
    }

    /// Live matchers.
    pub fn len(&self) -> usize {
        self.handle_to_matcher.len()
    }

    /// Whether no matcher is live.
    pub fn is_empty(&self) -> bool {
        self.handle_to_matcher.is_empty()
    }

    /// Compiled grammars in the cache.
    pub fn num_cached_grammars(&self) -> usize {
        self.grammars.len()
    }

    /// A copy of the counters.
    pub fn stats(&self) -> StructuredStats {
        self.stats
    }

    /// Compiles a grammar, or finds it in the cache. Bad or unsupported input is an
    /// `InvalidArgument` naming the problem.
    pub fn compile(&mut self, kind: GrammarKind, spec: &str) -> Result<GrammarId> {
        // The spec of a JSON object grammar is ignored: every spec is the same grammar.
        let key = (kind, if kind == GrammarKind::JsonObject { "" } else { spec }.to_owned());
        let tick = self.tick();
        if let Some(&grammar_id) = self.key_to_grammar_id.get(&key) {
            self.stats.cache_hits += 1;
            self.grammars.get_mut(&grammar_id).expect("cached key has a grammar").last_used = tick;
            return Ok(grammar_id);
        }
        let started = Instant::now();
        let template = self.compile_template(kind, &key.1);
        self.stats.compile_seconds_total += started.elapsed().as_secs_f64();
        let template = template?;
        self.stats.num_compiled += 1;
        let grammar_id = GrammarId(self.next_grammar_id);
        self.next_grammar_id += 1;
        self.key_to_grammar_id.insert(key.clone(), grammar_id);
        self.grammars.insert(grammar_id, CachedGrammar { key, template, last_used: tick });
        self.evict_least_recently_used();
        Ok(grammar_id)
    }

    /// Starts a new sequence at the beginning of a compiled grammar.
    pub fn add(&mut self, grammar_id: GrammarId) -> Result<MatcherHandle> {
        let tick = self.tick();
        let grammar =
            self.grammars.get_mut(&grammar_id).ok_or(Error::UnknownGrammar(grammar_id.0))?;
        grammar.last_used = tick;
        // NOTE: a deep clone. A plain clone shares the template's lexer behind one mutex,
        // so sequences of the same grammar would compute their masks one at a time.
        let matcher = grammar.template.deep_clone();
        let handle = MatcherHandle(self.next_handle);
        self.next_handle += 1;
        self.handle_to_matcher.insert(handle, matcher);
        Ok(handle)
    }

    /// Fills one mask row per handle (see the module docs for the layout) into `bitmask`,
    /// `handles.len() * num_mask_words()` words, in parallel across sequences.
    ///
    /// NOTE: rayon, not `std::thread::scope`: its pool's threads are started once, not every
    /// step, work stealing evens out rows of very different cost (inside a JSON string a
    /// mask takes microseconds, at a fresh lexeme milliseconds), and llguidance already
    /// depends on it.
    pub fn fill_bitmask(&mut self, handles: &[MatcherHandle], bitmask: &mut [i32]) -> Result<()> {
        let num_words = self.num_mask_words();
        if bitmask.len() != handles.len() * num_words {
            return Err(Error::InvalidArgument(format!(
                "bitmask has {} words, {} rows of {num_words} need {}",
                bitmask.len(),
                handles.len(),
                handles.len() * num_words
            )));
        }
        let started = Instant::now();
        let eos_token_id = self.eos_token_id;
        let matchers = self.matchers_for_rows(handles)?;
        bitmask
            .par_chunks_mut(num_words)
            .zip(matchers)
            .for_each(|(row, matcher)| fill_row(matcher, eos_token_id, row));
        self.stats.num_masks += handles.len() as u64;
        self.stats.mask_seconds_total += started.elapsed().as_secs_f64();
        Ok(())
    }

    /// Consumes a sampled token. `Ok(false)` when the grammar does not allow it here (the
    /// state is unchanged), or when consuming it made the matcher fail (see `error`). EOS is
    /// accepted wherever the text may end, and by a finished matcher.
    pub fn advance(&mut self, handle: MatcherHandle, token_id: TokenId) -> Result<bool> {
        if token_id as usize >= self.vocab_size {
            return Err(Error::InvalidArgument(format!(
                "token id {token_id} is not below vocab_size {}",
                self.vocab_size
            )));
        }
        let eos_token_id = self.eos_token_id;
        let matcher = self.matcher_mut(handle)?;
        if matcher.is_stopped() {
            return Ok(token_id == eos_token_id);
        }
        // `try_consume_tokens` checks a token before it consumes it: a refused token leaves
        // the matcher as it was.
        Ok(matcher.try_consume_tokens(&[token_id]).is_ok_and(|num_consumed| num_consumed == 1))
    }

    /// Whether the sequence's grammar has ended: EOS was consumed, nothing but EOS can
    /// follow, or the matcher failed.
    pub fn is_finished(&self, handle: MatcherHandle) -> Result<bool> {
        Ok(self.matcher(handle)?.is_stopped())
    }

    /// Why the matcher failed (a grammar past llguidance's limits), if it did.
    pub fn error(&self, handle: MatcherHandle) -> Result<Option<String>> {
        Ok(self.matcher(handle)?.get_error())
    }

    /// Frees a matcher.
    pub fn remove(&mut self, handle: MatcherHandle) -> Result<()> {
        self.handle_to_matcher.remove(&handle).map(drop).ok_or(Error::UnknownMatcher(handle.0))
    }

    fn tick(&mut self) -> u64 {
        self.use_clock += 1;
        self.use_clock
    }

    fn matcher(&self, handle: MatcherHandle) -> Result<&Matcher> {
        self.handle_to_matcher.get(&handle).ok_or(Error::UnknownMatcher(handle.0))
    }

    fn matcher_mut(&mut self, handle: MatcherHandle) -> Result<&mut Matcher> {
        self.handle_to_matcher.get_mut(&handle).ok_or(Error::UnknownMatcher(handle.0))
    }

    /// The matchers of `handles`, in row order; each handle live and listed once.
    fn matchers_for_rows(&mut self, handles: &[MatcherHandle]) -> Result<Vec<&mut Matcher>> {
        let mut handle_to_row = HashMap::with_capacity(handles.len());
        for (row, &handle) in handles.iter().enumerate() {
            if handle_to_row.insert(handle, row).is_some() {
                return Err(Error::InvalidArgument(format!(
                    "matcher handle {} is listed twice; a sequence has one mask row",
                    handle.0
                )));
            }
        }
        // NOTE: a map lends one `&mut` value at a time; walking all live matchers (a few
        // hundred at most) hands out every row's at once.
        let mut rows: Vec<Option<&mut Matcher>> = handles.iter().map(|_| None).collect();
        for (handle, matcher) in self.handle_to_matcher.iter_mut() {
            if let Some(&row) = handle_to_row.get(handle) {
                rows[row] = Some(matcher);
            }
        }
        rows.into_iter()
            .zip(handles)
            .map(|(matcher, handle)| matcher.ok_or(Error::UnknownMatcher(handle.0)))
            .collect()
    }

    /// A matcher at the start of the grammar, its first mask computed.
    fn compile_template(&self, kind: GrammarKind, spec: &str) -> Result<Matcher> {
        let grammar = top_level_grammar(kind, spec)?;
        let mut parser = self.factory.create_parser(grammar).map_err(|err| invalid(kind, err))?;
        parser.start_without_prompt();
        // NOTE: the first mask is computed once here: the lexer states it builds are copied
        // into every sequence's matcher, and a grammar no token can start is refused now
        // (a 400) instead of ending its requests with nothing.
        let first_mask = catch_unwind(AssertUnwindSafe(|| parser.compute_mask()))
            .map_err(|_| invalid(kind, "llguidance failed on it"))?;
        match first_mask {
            Ok(_) => Ok(Matcher::new(Ok(parser))),
            Err(_) if parser.stop_reason() == StopReason::NoExtensionBias => {
                Err(invalid(kind, "no token of the vocabulary can start its output"))
            }
            Err(err) => Err(invalid(kind, err)),
        }
    }

    fn evict_least_recently_used(&mut self) {
        while self.grammars.len() > self.max_cached_grammars {
            let oldest = self.grammars.iter().min_by_key(|(_, grammar)| grammar.last_used);
            let oldest_id = *oldest.expect("cache over capacity is not empty").0;
            let evicted = self.grammars.remove(&oldest_id).expect("found just now");
            self.key_to_grammar_id.remove(&evicted.key);
        }
    }
}

/// One row: the matcher's mask, or only EOS once it failed.
fn fill_row(matcher: &mut Matcher, eos_token_id: TokenId, row: &mut [i32]) {
    row.fill(0);
    match matcher.compute_mask_or_eos() {
        Ok(mask) => {
            for (word, &bits) in row.iter_mut().zip(mask.as_slice()) {
                *word = bits as i32;
            }
        }
        // The matcher keeps its error (see `error`); the sequence can only end.
        Err(_) => row[eos_token_id as usize / 32] |= 1 << (eos_token_id % 32),
    }
}

/// JSON output is compact: no whitespace anywhere outside strings, `,` between items and
/// `:` after keys (`json.dumps(value, separators=(",", ":"))`). Flexible whitespace lets
/// small models emit newlines and spaces without end instead of closing the object.
/// `oneOf` is compiled as `anyOf`: pydantic writes discriminated unions as `oneOf`, whose
/// branches the discriminator already keeps apart.
fn json_options() -> JsonCompileOptions {
    JsonCompileOptions {
        item_separator: ",".into(),
        key_separator: ":".into(),
        whitespace_flexible: false,
        coerce_one_of: true,
        ..JsonCompileOptions::default()
    }
}

/// The llguidance grammar of a spec; what cannot even be read is refused here.
fn top_level_grammar(kind: GrammarKind, spec: &str) -> Result<TopLevelGrammar> {
    let json_schema = |mut schema: Value| {
        // Our options replace any "x-guidance" options the schema carries.
        json_options().apply_to(&mut schema);
        TopLevelGrammar::from_json_schema(schema)
    };
    match kind {
        GrammarKind::JsonSchema => {
            let schema: Value = serde_json::from_str(spec).map_err(|err| {
                Error::InvalidArgument(format!("invalid JSON schema: not JSON ({err})"))
            })?;
            if !schema.is_object() {
                return Err(Error::InvalidArgument(format!(
                    "invalid JSON schema: must be a JSON object, got {}",
                    json_type_name(&schema)
                )));
            }
            Ok(json_schema(schema))
        }
        GrammarKind::JsonObject => Ok(json_schema(json!({"type": "object"}))),
        GrammarKind::Regex => Ok(TopLevelGrammar::from_regex(spec)),
        GrammarKind::Choice => Ok(TopLevelGrammar::from_lark(choice_grammar(spec)?)),
        GrammarKind::Grammar => {
            if spec.lines().any(|line| line.contains("::=")) {
                return Err(Error::InvalidArgument(
                    "invalid grammar: GBNF/EBNF rules (`name ::= ...`) are not supported; \
                     write the grammar in Lark syntax (`name: ...`, start rule `start`)"
                        .into(),
                ));
            }
            Ok(TopLevelGrammar::from_lark(spec.to_owned()))
        }
    }
}

/// `start: "a" | "b" | ...` for a JSON list of strings. Lark string literals are JSON
/// strings, so each choice is written as its JSON encoding.
fn choice_grammar(spec: &str) -> Result<String> {
    let bad = |why: String| Error::InvalidArgument(format!("invalid choice list: {why}"));
    let choices: Vec<String> = serde_json::from_str(spec)
        .map_err(|err| bad(format!("expected a JSON list of strings ({err})")))?;
    if choices.is_empty() {
        return Err(bad("the list is empty".into()));
    }
    let literals: Vec<String> = choices
        .iter()
        .map(|choice| serde_json::to_string(choice).expect("a string encodes as JSON"))
        .collect();
    Ok(format!("start: {}", literals.join(" | ")))
}

fn json_type_name(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// llguidance's message, prefixed with what was being compiled.
fn invalid(kind: GrammarKind, err: impl std::fmt::Display) -> Error {
    let what = match kind {
        GrammarKind::JsonSchema | GrammarKind::JsonObject => "JSON schema",
        GrammarKind::Regex => "regex",
        GrammarKind::Choice => "choice list",
        GrammarKind::Grammar => "grammar",
    };
    let message = err.to_string();
    let message = message.trim_end();
    let message = match message.strip_prefix("Unimplemented keys: ") {
        Some(keywords) => format!("unsupported keywords {keywords}"),
        None => message.to_owned(),
    };
    Error::InvalidArgument(format!("invalid {what}: {message}"))
}

#[cfg(test)]
#[path = "structured_tests.rs"]
mod tests;
