use super::*;
use crate::sequence::{RequestHandle, StopConditions};

fn config(num_blocks: usize, max_num_batched_tokens: usize) -> SchedulerConfig {
    SchedulerConfig {
        num_blocks,
        block_size: 4,
        max_num_batched_tokens,
        max_num_seqs: 8,
        max_model_len: 1024,
        ..Default::default()
    }
}

fn params(max_tokens: usize) -> RequestParams {
    RequestParams {
        stop: StopConditions { max_tokens, ..Default::default() },
        ..Default::default()
    }
}

pub(super) fn prompt(len: usize, first: u32) -> Vec<u32> {
    (0..len as u32).map(|i| first + i).collect()
}

/// One step with a fake model that samples `token` for every logits row.
pub(super) fn step(s: &mut Scheduler, token: u32) -> (SchedulerOutput, Vec<SequenceUpdate>) {
    let out = s.schedule().unwrap();
    let sampled = vec![token; out.logits_indices.len()];
    let updates = s.update_from_output(&sampled).unwrap();
    s.check_invariants().unwrap();
    (out, updates)
}

fn scheduled_tokens(out: &SchedulerOutput) -> Vec<i32> {
    out.num_scheduled_tokens.clone()
}

fn run_to_completion(s: &mut Scheduler) -> usize {
    let mut steps = 0;
    while s.has_unfinished_requests() {
        step(s, 7);
        steps += 1;
        assert!(steps < 10_000, "no progress");
    }
    steps
}

#[test]
fn budget_is_respected_exactly_and_prompts_are_chunked() {
    let mut s = Scheduler::new(config(64, 10)).unwrap();
    s.add_request("a", &prompt(7, 0), params(2)).unwrap();
    s.add_request("b", &prompt(7, 100), params(2)).unwrap();
    let (out, updates) = step(&mut s, 1);
    // a takes 7, b gets the 3 left over as a partial chunk: exactly the budget.
    assert_eq!(scheduled_tokens(&out), vec![7, 3]);
    assert_eq!(out.num_batched_tokens(), 10);
    assert_eq!(out.logits_indices, vec![6], "only a caught up");
    assert_eq!(updates.len(), 1);
    let (out, _) = step(&mut s, 1);
    // a decodes (1 token), b finishes its prompt (4 tokens).
    assert_eq!(scheduled_tokens(&out), vec![1, 4]);
    assert_eq!(out.positions, vec![7, 3, 4, 5, 6]);
    assert_eq!(out.logits_indices, vec![0, 4]);
}

#[test]
fn output_arrays_describe_the_batch() {
    let mut s = Scheduler::new(config(64, 64)).unwrap();
    s.add_request("a", &prompt(6, 10), params(3)).unwrap();
    let (out, _) = step(&mut s, 99);
    assert_eq!(out.input_token_ids, vec![10, 11, 12, 13, 14, 15]);
    assert_eq!(out.query_start_loc, vec![0, 6]);
    assert_eq!(out.context_lens, vec![6]);
    assert_eq!(out.prompt_lens, vec![6]);
    let table = s.kv_cache().block_table(out.sequence_ids[0]).unwrap().to_vec();
    let slot = |p: usize| (table[p / 4].0 as usize * 4 + p % 4) as i64;
    assert_eq!(out.slot_mapping, (0..6).map(slot).collect::<Vec<_>>());
    assert_eq!(out.block_table_width, 2);
    assert_eq!(out.block_tables, vec![table[0].0 as i32, table[1].0 as i32]);
    let (out, _) = step(&mut s, 98);
    assert_eq!(out.input_token_ids, vec![99]);
    assert_eq!(out.positions, vec![6]);
    assert_eq!(out.slot_mapping, vec![slot(6)]);
    assert_eq!(out.context_lens, vec![7]);
    assert_eq!(out.prompt_lens, vec![6]);
    assert_eq!((out.num_prefill_tokens, out.num_decode_tokens), (0, 1));
}

#[test]
fn decodes_are_never_starved_by_a_long_prefill() {
    let mut s = Scheduler::new(config(256, 16)).unwrap();
    for i in 0..4 {
        s.add_request(&format!("short{i}"), &prompt(2, 10 * i), params(50)).unwrap();
    }
    step(&mut s, 1);
    assert_eq!(s.num_running(), 4);
    s.add_request("long", &prompt(400, 1000), params(5)).unwrap();
    for _ in 0..10 {
        let (out, _) = step(&mut s, 1);
        assert_eq!(out.num_decode_tokens, 4, "every decode runs every step");
        assert!(out.num_batched_tokens() <= 16);
    }
    // The long prompt advances with whatever the decodes leave.
    let long = s.sequences.iter().find(|r| r.num_prompt_tokens == 400).unwrap();
    assert!(long.num_computed_tokens >= 100);
}

#[test]
fn long_prefill_threshold_caps_a_chunk_and_partial_prefills_are_limited() {
    let mut cfg = config(256, 64);
    cfg.long_prefill_token_threshold = Some(8);
    cfg.max_num_partial_prefills = 1;
    let mut s = Scheduler::new(cfg).unwrap();
    s.add_request("a", &prompt(40, 0), params(1)).unwrap();
    s.add_request("b", &prompt(40, 100), params(1)).unwrap();
    let (out, _) = step(&mut s, 1);
    // a takes 8 (the cap); b would also be partial, over the limit of 1: not admitted.
    assert_eq!(scheduled_tokens(&out), vec![8]);
    assert_eq!(s.num_waiting(), 1);
}

#[test]
fn priority_policy_admits_lower_values_first() {
    let mut cfg = config(64, 8);
    cfg.policy = SchedulingPolicy::Priority;
    let mut s = Scheduler::new(cfg).unwrap();
    let with_priority = |priority| RequestParams { priority, ..params(1) };
    s.add_request("low", &prompt(8, 0), with_priority(5)).unwrap();
    s.add_request("high", &prompt(8, 100), with_priority(-1)).unwrap();
    s.add_request("mid", &prompt(8, 200), with_priority(0)).unwrap();
    let mut order = Vec::new();
    while s.has_unfinished_requests() {
        let out = s.schedule().unwrap();
        order.extend(out.requests.iter().map(|&g| s.external_id(g).unwrap().to_string()));
        s.update_from_output(&vec![1; out.logits_indices.len()]).unwrap();
    }
    assert_eq!(order, vec!["high", "mid", "low"]);
}

#[test]
fn fcfs_ignores_priority_and_keeps_arrival_order() {
    let mut s = Scheduler::new(config(64, 8)).unwrap();
    s.add_request("first", &prompt(8, 0), RequestParams { priority: 9, ..params(1) }).unwrap();
    s.add_request("second", &prompt(8, 50), RequestParams { priority: -9, ..params(1) }).unwrap();
    let (out, _) = step(&mut s, 1);
    assert_eq!(s.external_id(out.requests[0]).map(|id| id.to_string()), None, "finished");
    assert_eq!(s.num_waiting(), 1);
    assert_eq!(
        s.external_id(s.sequences.iter().next().unwrap().request).unwrap().as_ref(),
        "second"
    );
}

#[test]
fn preemption_frees_blocks_resumes_with_the_same_tokens_and_is_counted() {
    // 6 blocks of 4 tokens: two requests of 8 prompt tokens fit, but not once both grow.
    let mut s = Scheduler::new(config(6, 64)).unwrap();
    s.add_request("old", &prompt(8, 0), params(12)).unwrap();
    s.add_request("new", &prompt(8, 100), params(12)).unwrap();
    let mut preempted = Vec::new();
    let mut seen_preempted_status = false;
    let mut texts: std::collections::HashMap<(RequestHandle, usize), Vec<u32>> = Default::default();
    let mut token = 0;
    while s.has_unfinished_requests() {
        token += 1;
        let (out, updates) = step(&mut s, token);
        for &id in &out.preempted {
            let (request, _) = s.sequence_of(id).expect("preempted sequences stay queued");
            let name = s.external_id(request).unwrap().to_string();
            seen_preempted_status |= s.status(&name, 0) == Ok(SequenceStatus::Preempted);
            preempted.push(name);
        }
        for update in updates {
            texts
                .entry((update.request, update.choice_index))
                .or_default()
                .extend(update.new_token_id);
        }
        assert!(s.kv_cache().stats().num_used_blocks <= 6);
    }
    assert!(!preempted.is_empty());
    assert!(matches!(s.status("old", 0), Err(Error::UnknownRequest(_))), "finished: forgotten");
    assert_eq!(s.stats().num_preemptions_total as usize, preempted.len());
    // The later arrival was the victim, and both still got all their tokens, each in order.
    assert!(preempted.iter().all(|id| id == "new"));
    assert!(seen_preempted_status);
    for tokens in texts.values() {
        assert_eq!(tokens.len(), 12);
        assert!(tokens.windows(2).all(|w| w[0] < w[1]), "resumed where it left off");
    }
    assert_eq!(s.kv_cache().num_free_blocks(), 6);
}

#[test]
fn abort_in_every_state_frees_everything() {
    let mut s = Scheduler::new(config(5, 8)).unwrap();
    s.add_request("running", &prompt(6, 0), params(50)).unwrap();
    s.add_request("partial", &prompt(9, 100), params(50)).unwrap();
    s.add_request("waiting", &prompt(4, 200), params(50)).unwrap();
    step(&mut s, 1);
    assert_eq!(s.num_running(), 2);
    // Abort between schedule and update too: its sampled row is dropped.
    let out = s.schedule().unwrap();
    s.abort_request("running").unwrap();
    let updates = s.update_from_output(&vec![1; out.logits_indices.len()]).unwrap();
    assert!(updates
        .iter()
        .all(|u| s.external_id(u.request).map(|id| id.as_ref()) != Some("running")));
    s.abort_request("partial").unwrap();
    s.abort_request("waiting").unwrap();
    assert!(!s.has_unfinished_requests());
    assert_eq!(s.kv_cache().num_free_blocks(), 5);
    assert!(matches!(s.abort_request("waiting"), Err(Error::UnknownRequest(_))));
    s.check_invariants().unwrap();
}

#[test]
fn a_request_that_can_never_fit_ends_with_capacity() {
    // Prompt of 30 tokens needs 8 blocks of 4; the cache has 4.
    let mut s = Scheduler::new(config(4, 64)).unwrap();
    s.add_request("huge", &prompt(30, 0), params(4)).unwrap();
    s.add_request("small", &prompt(3, 100), params(2)).unwrap();
    let (_, updates) = step(&mut s, 1);
    assert_eq!(updates[0].finish_reason, Some(FinishReason::Capacity));
    // One that fits its prompt but outgrows the cache while decoding ends the same way.
    let mut s = Scheduler::new(config(2, 64)).unwrap();
    s.add_request("grows", &prompt(6, 0), params(20)).unwrap();
    let mut reasons = Vec::new();
    for _ in 0..10 {
        let (_, updates) = step(&mut s, 1);
        reasons.extend(updates.iter().filter_map(|u| u.finish_reason));
    }
    assert_eq!(reasons, vec![FinishReason::Capacity]);
    assert!(!s.has_unfinished_requests());
    assert_eq!(s.kv_cache().num_free_blocks(), 2);
    // With n = 3, every choice is reported, the forks that never happened too (the caller
    // waits for each of them).
    let mut s = Scheduler::new(config(4, 64)).unwrap();
    s.add_request("huge", &prompt(30, 0), RequestParams { n: 3, ..params(4) }).unwrap();
    let (_, updates) = step(&mut s, 1);
    let choices: Vec<_> = updates.iter().map(|u| (u.choice_index, u.finish_reason)).collect();
    let capacity = Some(FinishReason::Capacity);
    assert_eq!(choices, vec![(0, capacity), (1, capacity), (2, capacity)]);
    assert!(!s.has_unfinished_requests());
}

#[test]
fn prefix_hits_skip_compute() {
    let mut s = Scheduler::new(config(64, 64)).unwrap();
    s.add_request("a", &prompt(18, 0), params(1)).unwrap();
    run_to_completion(&mut s);
    s.add_request("b", &prompt(18, 0), params(1)).unwrap();
    let (out, _) = step(&mut s, 1);
    assert_eq!(scheduled_tokens(&out), vec![2], "16 of 18 prompt tokens were cached");
    assert_eq!(out.positions, vec![16, 17]);
    assert_eq!(out.context_lens, vec![18]);
    assert_eq!(s.stats().prefix_cache_hits, 16);
}

#[test]
fn num_cached_tokens_is_the_prefix_hit_when_first_scheduled() {
    let mut s = Scheduler::new(config(64, 64)).unwrap();
    s.add_request("first", &prompt(18, 0), params(2)).unwrap();
    let (_, updates) = step(&mut s, 1);
    assert_eq!(updates[0].num_cached_tokens, 0, "nothing was cached yet");
    run_to_completion(&mut s);
    // The same prompt again: its first 4 full blocks are cached (never its last token).
    s.add_request("again", &prompt(18, 0), RequestParams { n: 3, ..params(2) }).unwrap();
    s.add_request("fresh", &prompt(18, 500), params(2)).unwrap();
    let (again, fresh) = (s.request_handle("again").unwrap(), s.request_handle("fresh").unwrap());
    let mut again_rows = Vec::new();
    let mut fresh_rows = Vec::new();
    while s.has_unfinished_requests() {
        for update in step(&mut s, 1).1 {
            let row = (update.choice_index, update.num_cached_tokens);
            if update.request == again {
                again_rows.push(row);
            } else if update.request == fresh {
                fresh_rows.push(row);
            }
        }
    }
    // Two tokens for each of the three choices, each row with the request's hit.
    again_rows.sort();
    assert_eq!(again_rows, vec![(0, 16), (0, 16), (1, 16), (1, 16), (2, 16), (2, 16)]);
    assert_eq!(fresh_rows, vec![(0, 0), (0, 0)]);
}

#[test]
fn num_cached_tokens_is_kept_through_preemption() {
    // As in the preemption test: "new" is preempted and recomputed, finding its own
    // prefix cached when it is readmitted, yet it keeps reporting its first hit (none).
    let mut s = Scheduler::new(config(6, 64)).unwrap();
    s.add_request("old", &prompt(8, 0), params(12)).unwrap();
    s.add_request("new", &prompt(8, 100), params(12)).unwrap();
    let new = s.request_handle("new").unwrap();
    let mut num_preempted = 0;
    while s.has_unfinished_requests() {
        let (out, updates) = step(&mut s, 1);
        num_preempted += out.preempted.len();
        assert!(updates.iter().all(|u| u.num_cached_tokens == 0));
        if let Some(num_cached) = s.num_cached_tokens(new) {
            assert_eq!(num_cached, 0);
        }
    }
    assert!(num_preempted > 0);
    assert!(s.stats().prefix_cache_hits > 0, "the recomputation found its prefix cached");
}

#[test]
fn a_prompt_one_short_of_max_model_len_generates_one_token() {
    let cfg = SchedulerConfig { max_model_len: 16, ..config(64, 64) };
    let mut s = Scheduler::new(cfg).unwrap();
    s.add_request("full", &prompt(15, 0), params(100)).unwrap();
    let (out, updates) = step(&mut s, 1);
    assert!(out.positions.iter().all(|&p| p < 15), "every computed position is < 15");
    assert_eq!(updates.len(), 1);
    assert_eq!(updates[0].new_token_id, Some(1));
    assert_eq!(updates[0].finish_reason, Some(FinishReason::Length));
    assert!(!s.has_unfinished_requests());
    // A shorter prompt stops once prompt and output together reach max_model_len.
    s.add_request("short", &prompt(10, 0), params(100)).unwrap();
    let mut num_generated = 0;
    while s.has_unfinished_requests() {
        let (out, updates) = step(&mut s, 1);
        assert!(out.positions.iter().all(|&p| p < 16));
        num_generated += updates.len();
    }
    assert_eq!(num_generated, 6);
}

#[test]
fn a_prompt_that_leaves_no_room_for_output_is_refused_naming_both_lengths() {
    let cfg = SchedulerConfig { max_model_len: 16, ..config(64, 64) };
    let mut s = Scheduler::new(cfg).unwrap();
    let err = s.add_request("long", &prompt(16, 0), params(1)).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)));
    assert_eq!(
        err.to_string(),
        "the prompt has 16 tokens; max_model_len is 16 (prompt and output together, at least \
         one output token)"
    );
    assert!(!s.has_unfinished_requests());
    assert_eq!(s.request_handle("long"), None);
}

#[test]
fn default_request_params_ask_for_one_choice() {
    let defaults = RequestParams::default();
    assert_eq!(defaults.n, 1);
    let mut s = Scheduler::new(config(64, 64)).unwrap();
    s.add_request("plain", &prompt(3, 0), RequestParams::default()).unwrap();
    let mut num_generated = 0;
    while s.has_unfinished_requests() {
        let (_, updates) = step(&mut s, 1);
        assert!(updates.iter().all(|u| u.choice_index == 0));
        num_generated += updates.len();
    }
    assert_eq!(num_generated, defaults.stop.max_tokens);
}

#[test]
fn n_choices_prefill_once_then_fork_and_decode_independently() {
    let mut s = Scheduler::new(config(64, 64)).unwrap();
    s.add_request("multi", &prompt(6, 0), RequestParams { n: 3, ..params(4) }).unwrap();
    let (out, updates) = step(&mut s, 5);
    assert_eq!(scheduled_tokens(&out), vec![6], "the prompt is computed once");
    assert_eq!(out.logits_indices, vec![5, 5, 5]);
    let mut choices: Vec<usize> = updates.iter().map(|u| u.choice_index).collect();
    choices.sort();
    assert_eq!(choices, vec![0, 1, 2]);
    assert_eq!(s.num_running(), 3);
    // The three share the full block; each gets its own copy of the partial one.
    let (out, _) = step(&mut s, 6);
    assert_eq!(scheduled_tokens(&out), vec![1, 1, 1]);
    assert_eq!(out.block_copies.len(), 2, "the last writer keeps the original");
    let first_blocks: Vec<i32> = (0..3).map(|row| out.block_tables[row * 2]).collect();
    assert!(first_blocks.iter().all(|&b| b == first_blocks[0]));
    run_to_completion(&mut s);
    assert_eq!(s.kv_cache().num_free_blocks(), 64);
}

#[test]
fn stop_conditions_end_requests_and_free_their_blocks() {
    let mut s = Scheduler::new(config(64, 64)).unwrap();
    let eos = RequestParams {
        stop: StopConditions { max_tokens: 10, eos_token_id: Some(2), ..Default::default() },
        ..Default::default()
    };
    s.add_request("eos", &prompt(3, 0), eos).unwrap();
    s.add_request("len", &prompt(3, 10), params(1)).unwrap();
    let (_, updates) = step(&mut s, 2);
    let reasons: Vec<_> = updates.iter().map(|u| u.finish_reason).collect();
    assert_eq!(reasons, vec![Some(FinishReason::Stop), Some(FinishReason::Length)]);
    assert!(!s.has_unfinished_requests());
    assert_eq!(s.kv_cache().num_free_blocks(), 64);
    s.add_request("eos", &prompt(3, 0), params(1)).unwrap(); // ids are reusable
}

#[test]
fn finish_request_ends_one_choice_for_a_python_side_stop() {
    let mut s = Scheduler::new(config(64, 64)).unwrap();
    s.add_request("r", &prompt(3, 0), RequestParams { n: 2, ..params(10) }).unwrap();
    step(&mut s, 1);
    s.finish_request("r", 1).unwrap();
    assert!(matches!(s.status("r", 1), Err(Error::InvalidArgument(_))), "choice 1 ended");
    let (out, _) = step(&mut s, 1);
    assert_eq!(out.choice_indices, vec![0], "choice 0 runs on");
    s.finish_request("r", 0).unwrap();
    assert!(!s.has_unfinished_requests());
    assert_eq!(s.kv_cache().num_free_blocks(), 64);
    assert!(matches!(s.finish_request("r", 0), Err(Error::UnknownRequest(_))));
}

#[test]
fn a_finish_the_caller_decided_is_not_echoed() {
    let mut s = Scheduler::new(config(64, 64)).unwrap();
    s.add_request("stopped", &prompt(3, 0), params(10)).unwrap();
    s.add_request("other", &prompt(3, 10), params(10)).unwrap();
    step(&mut s, 1);
    // Between steps, and between `schedule` and `update_from_output` (its row is dropped).
    s.finish_request("stopped", 0).unwrap();
    let (out, updates) = step(&mut s, 1);
    assert_eq!(out.sequence_ids.len(), 1);
    let names: Vec<&str> =
        updates.iter().map(|u| s.external_id(u.request).unwrap().as_ref()).collect();
    assert_eq!(names, vec!["other"]);
    let out = s.schedule().unwrap();
    s.finish_request("other", 0).unwrap();
    let updates = s.update_from_output(&vec![1; out.logits_indices.len()]).unwrap();
    assert!(updates.is_empty());
    assert!(!s.has_unfinished_requests());
}

#[test]
fn nothing_more_is_reported_about_an_aborted_request() {
    let mut s = Scheduler::new(config(64, 64)).unwrap();
    s.add_request("r", &prompt(3, 0), RequestParams { n: 2, ..params(10) }).unwrap();
    step(&mut s, 1);
    // As if `schedule` had ended choice 1 for capacity while choice 0 lives on.
    let child = s.requests[s.request_handle("r").unwrap()].choices[1];
    s.end_for_capacity(child).unwrap();
    s.abort_request("r").unwrap();
    assert!(!s.has_unfinished_requests());
    assert!(s.update_from_output(&[]).unwrap().is_empty());
}

#[test]
fn updates_name_the_logits_row_of_their_token() {
    let mut s = Scheduler::new(config(64, 64)).unwrap();
    s.add_request("single", &prompt(3, 0), params(10)).unwrap();
    s.add_request("multi", &prompt(5, 20), RequestParams { n: 3, ..params(10) }).unwrap();
    let out = s.schedule().unwrap();
    assert_eq!(out.logits_indices, vec![2, 7, 7, 7]);
    assert_eq!(out.logits_request_indices, vec![0, 1, 1, 1]);
    assert_eq!(out.logits_choice_indices, vec![0, 0, 1, 2]);
    let updates = s.update_from_output(&[10, 11, 12, 13]).unwrap();
    let rows: Vec<_> =
        updates.iter().map(|u| (u.choice_index, u.new_token_id, u.logits_row)).collect();
    assert_eq!(
        rows,
        vec![
            (0, Some(10), Some(0)),
            (0, Some(11), Some(1)),
            (1, Some(12), Some(2)),
            (2, Some(13), Some(3))
        ]
    );
    // Forks decode as sequences of their own, one row each.
    let out = s.schedule().unwrap();
    assert_eq!(
        out.logits_choice_indices,
        out.choice_indices.iter().map(|&c| c as i32).collect::<Vec<_>>()
    );
    let updates = s.update_from_output(&[20, 21, 22, 23]).unwrap();
    for update in &updates {
        let row = update.logits_row.unwrap();
        assert_eq!(update.new_token_id, Some(20 + row as u32));
        assert_eq!(out.logits_choice_indices[row], update.choice_index as i32);
        assert_eq!(out.requests[out.logits_request_indices[row] as usize], update.request);
    }
    // A sequence `schedule` ends on its own got no token, so it has no row.
    let mut s = Scheduler::new(config(4, 64)).unwrap();
    s.add_request("huge", &prompt(30, 0), params(4)).unwrap();
    let (_, updates) = step(&mut s, 1);
    assert_eq!((updates[0].new_token_id, updates[0].logits_row), (None, None));
}

#[test]
fn bad_requests_and_configs_are_errors() {
    let mut cfg = config(8, 4);
    cfg.max_num_seqs = 8;
    assert!(matches!(Scheduler::new(cfg), Err(Error::InvalidArgument(_))));
    let mut s = Scheduler::new(config(8, 8)).unwrap();
    assert!(matches!(
        s.add_request("a", &prompt(2000, 0), params(1)),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(s.add_request("a", &[], params(1)), Err(Error::InvalidArgument(_))));
    assert!(matches!(s.add_request("a", &[1], params(0)), Err(Error::InvalidArgument(_))));
    assert!(matches!(
        s.add_request("a", &[1], RequestParams { n: 0, ..params(1) }),
        Err(Error::InvalidArgument(_))
    ));
    s.add_request("a", &[1], params(1)).unwrap();
    assert!(matches!(s.add_request("a", &[1], params(1)), Err(Error::DuplicateRequest(_))));
    s.schedule().unwrap();
    assert!(matches!(s.update_from_output(&[1, 2]), Err(Error::InvalidArgument(_))));
    assert!(s.update_from_output(&[1]).is_ok());
}

#[test]
fn a_prompt_logprobs_request_computes_its_whole_prompt_yet_caches_it_for_others() {
    let mut s = Scheduler::new(config(64, 64)).unwrap();
    let logprobs = || RequestParams { prompt_logprobs: true, ..params(1) };
    s.add_request("first", &prompt(18, 0), logprobs()).unwrap();
    let (out, updates) = step(&mut s, 1);
    assert_eq!(scheduled_tokens(&out), vec![18]);
    assert_eq!(updates[0].num_cached_tokens, 0);
    // Its full blocks were cached: an ordinary request with the same prompt hits them.
    s.add_request("ordinary", &prompt(18, 0), params(1)).unwrap();
    let (out, updates) = step(&mut s, 1);
    assert_eq!(scheduled_tokens(&out), vec![2], "16 of 18 prompt tokens were cached");
    assert_eq!(updates[0].num_cached_tokens, 16);
    // Another one that wants prompt logprobs takes no hit, though the prefix is cached.
    s.add_request("again", &prompt(18, 0), logprobs()).unwrap();
    let (out, updates) = step(&mut s, 1);
    assert_eq!(scheduled_tokens(&out), vec![18]);
    assert_eq!(out.positions.first(), Some(&0));
    assert_eq!(updates[0].num_cached_tokens, 0);
    assert_eq!(s.stats().prefix_cache_hits, 16);
}

#[test]
fn check_invariants_finds_a_sequence_in_two_queues() {
    let mut s = Scheduler::new(config(64, 64)).unwrap();
    s.add_request("a", &prompt(6, 0), params(4)).unwrap();
    step(&mut s, 1);
    s.check_invariants().unwrap();
    let id = s.running[0];
    let key = s.sequences[id].key;
    s.waiting.insert(key, id);
    assert!(matches!(s.check_invariants(), Err(Error::InvariantViolation(_))));
}
