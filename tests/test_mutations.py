"""Deliberate mutations of fourd's source, each caught by a named test (`make mutation`; not part of `make test`).

A mutation replaces one exact piece of text in one source file, in a copy of the repository, and runs its named
tests there with pytest in a fresh process (forked from a server that has imported torch once; PYTHONPATH, sys.path
and the working directory are the copy, and the run checks that `import fourd` is the mutated copy). It is caught
when those tests fail. The anchor must occur exactly once: a refactor that removes or
repeats it fails here by name, never silently disables the mutation. A control first runs every named test on an
unmutated copy (on two pytest workers): a test that fails anyway catches nothing. The mutations then run two at a
time, each in one of two copies (this machine has two cores).

The table below is the one place that names the tests (`path::name`, as pytest takes them). Only the runs carry
the `mutation` marker that `make test` leaves out; the check of anchors and test names is part of it.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import queue
import shutil
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COPIED = ("fourd", "tests", "configs", "benchmarks", "pyproject.toml")

# name: (source file, exact text, its replacement, the tests that must fail)
MUTATIONS: dict[str, tuple[str, str, str, tuple[str, ...]]] = {
    # pipeline bubbles: the schedule, the two simulators, the planner and the lab
    "1f1b warm-up one forward too many": (
        "fourd/schedules.py",
        '[Action("B", rank, j) for j in range(microbatches)],\n'
        "        min(pp_ranks - 1 - rank, microbatches),",
        '[Action("B", rank, j) for j in range(microbatches)],\n'
        "        min(pp_ranks - rank, microbatches),",
        ("tests/test_schedules.py::test_small_orders_exactly",),
    ),
    "simulated idle fraction misses one action per rank": (
        "fourd/sim/step.py",
        "(step - sum(x.end - x.start for x in rank_events)) / step",
        "(step - sum(x.end - x.start for x in rank_events[1:])) / step",
        ("tests/test_sim_pipeline.py::test_gpipe_bubble_on_16_ranks",),
    ),
    "step simulator's bubble is the least busy rank's": (
        "fourd/sim/step.py",
        "return 1 - max(self.busy_s) / self.pipeline_span_s",
        "return 1 - min(self.busy_s) / self.pipeline_span_s",
        (
            "tests/test_sim_step.py::test_bubble_fraction_is_the_busiest_ranks_idle_share_of_the_span",
        ),
    ),
    "planner's 1F1B bubble is p, not p - 1, stage times": (
        "fourd/plan/perf.py",
        "return (p - 1) * whole",
        "return p * whole",
        ("tests/test_plan_model.py::test_bubble_per_schedule",),
    ),
    "planner's rank orders put the data-parallel ranks outside the pipeline either way": (
        "fourd/plan/cluster.py",
        'return order.index("dp") < order.index("pp")',
        'return order.index("dp") > order.index("pp")',
        ("tests/test_plan_rank_order.py::test_the_shard_and_replica_groups_follow_the_order",),
    ),
    "planner's placement strides every dimension by the innermost degree only": (
        "fourd/plan/cluster.py",
        "        stride *= degree\n",
        "        stride = degree\n",
        (
            "tests/test_plan_rank_order.py::test_each_order_gives_each_dimension_the_stride_of_the_degrees_inside_it",
        ),
    ),
    "planner's autocast sums even a step's first microbatch into the FP32 gradient": (
        "fourd/plan/perf.py",
        "summed_share = (microbatches - 1) / microbatches",
        "summed_share = microbatches / microbatches",
        (
            "tests/test_plan_stack.py::test_autocast_follows_the_stack_and_costs_its_casts_and_gradient_sums",
        ),
    ),
    "planner's autocast only where no data-parallel wrapper casts, whatever the stack": (
        "fourd/plan/job.py",
        'return mode == "always" or (mode == "unwrapped" and replicas == 1)',
        'return mode != "never" and replicas == 1',
        (
            "tests/test_plan_stack.py::test_autocast_follows_the_stack_and_costs_its_casts_and_gradient_sums",
        ),
    ),
    "planner's eager softmax in BF16 under autocast": (
        "fourd/plan/block.py",
        "softmax_bytes = F32 if work.autocast else b",
        "softmax_bytes = b",
        ("tests/test_contract_block.py::test_eager_attention_moves_the_counted_bytes_per_score",),
    ),
    "planner's open search offers a DDP stack tensor and pipeline parallelism": (
        "fourd/plan/search.py",
        'if not fixed["layout"] and not stack.runs_layout(lay):',
        'if not fixed["layout"] and stack.runs_layout(lay) and False:',
        (
            "tests/test_plan_stack.py::test_an_open_search_keeps_to_the_model_parallel_dimensions_the_stack_runs",
        ),
    ),
    "lab's bubble readout leaves out rank 0": (
        "fourd/lab/api.py",
        '"idle_fraction": sum(idle) / p',
        '"idle_fraction": sum(idle[1:]) / p',
        ("tests/test_lab_api.py::test_gpipe_bubble_figures",),
    ),
    "ring all-reduce skips its last step": (
        "fourd/comm/ring.py",
        "steps = 2 * (ranks - 1)  #",
        "steps = 2 * (ranks - 1) - 1  #",
        ("tests/test_comm_ring.py::test_ring_equals_all_reduce_and_sends_the_lower_bound",),
    ),
    "checkpoint verify skips the SHA-256 comparison": (
        "fourd/ckpt/store.py",
        'if sha256_file(path) != want["sha256"]:',
        "if False:",
        ("tests/test_ckpt_store.py::test_bit_flip_is_named",),
    ),
    "samples addressed one index late": (
        "fourd/data/dataset.py",
        "epoch, j = divmod(index, self.windows)",
        "epoch, j = divmod(index + 1, self.windows)",
        ("tests/test_data_stream.py::test_an_epoch_visits_every_window_once",),
    ),
    "training windows reach into the held-out tail": (
        "fourd/data/dataset.py",
        "windows = (train_tokens - 1) // seq_len",
        "windows = (tokens - 1) // seq_len",
        ("tests/test_data_stream.py::test_no_training_sample_reaches_the_held_out_tail",),
    ),
    "CP mask hides each token from itself": (
        "fourd/parallel/cp.py",
        "mask = self.q_pos[:, None] >= self.k_pos[None, :]",
        "mask = self.q_pos[:, None] > self.k_pos[None, :]",
        ("tests/test_parallel_cp.py::test_cp2_and_cp4_equal_single_process",),
    ),
    "CP rank holds the wrong second chunk": (
        "fourd/parallel/cp.py",
        "first, second = cp_rank, 2 * cp - 1 - cp_rank",
        "first, second = cp_rank, cp + cp_rank",
        ("tests/test_parallel_cp.py::test_each_rank_holds_chunks_i_and_mirror",),
    ),
    "HF import permutes K's rows as if K had the query heads": (
        "fourd/hf/convert.py",
        "return interleaved_to_halves(weight, cfg.kv_heads, inverse)",
        "return interleaved_to_halves(weight, cfg.heads, inverse)",
        ("tests/test_hf_convert.py::test_imported_logits_equal_transformers",),
    ),
    "MFU's FLOPs drop the attention term": (
        "fourd/model/config.py",
        "model = 6 * (self.non_embedding_params() + self.embedding_params()) + attention",
        "model = 6 * (self.non_embedding_params() + self.embedding_params())",
        ("tests/test_model_llama.py::test_flops_per_token_of_the_debug_preset",),
    ),
    "MFU's FLOPs drop the output projection": (
        "fourd/model/config.py",
        "model = 6 * (self.non_embedding_params() + self.embedding_params()) + attention",
        "model = 6 * self.non_embedding_params() + attention",
        ("tests/test_model_llama.py::test_flops_per_token_of_the_debug_preset",),
    ),
    "vocabulary-parallel loss adds every rank's column 0 as the target": (
        "fourd/parallel/tp.py",
        "target_logit = shifted.gather(1, local_t[:, None]).squeeze(1) * mine",
        "target_logit = shifted.gather(1, local_t[:, None]).squeeze(1)",
        (
            "tests/test_parallel_tp_dp.py::test_vocabulary_parallel_loss_and_gradient_equal_cross_entropy",
        ),
    ),
    "gradient clipping measures but does not scale": (
        "fourd/parallel/grad.py",
        "param.grad.mul_(scale)",
        "param.grad.mul_(1.0)",
        ("tests/test_train_step.py::test_clipping_scales_every_gradient_to_the_bound",),
    ),
    "weight decay applied to norm weights": (
        "fourd/train/step.py",
        'n.endswith("norm.weight") == norm',
        'n.endswith("norm.bias") == norm',
        ("tests/test_train_step.py::test_norm_weights_and_only_they_skip_weight_decay",),
    ),
    "planner shards gradients from ZeRO 1": (
        "fourd/plan/memory.py",
        "g / dp if zero >= 2 else g",
        "g / dp if zero >= 1 else g",
        ("tests/test_plan_arith.py::test_zero_bytes_per_parameter",),
    ),
    "selective recomputation keeps everything": (
        "fourd/parallel/recompute.py",
        'if mode == "none":\n        return stage',
        'if mode != "full":\n        return stage',
        ("tests/test_parallel_recompute.py::test_kept_bytes_equal_the_planners_formula",),
    ),
    "fault simulator counts planned stops past the horizon": (
        "fourd/sim/faults.py",
        "planned = (rng.random((runs, slots)) < lam_p / lam) & happened",
        "planned = rng.random((runs, slots)) < lam_p / lam",
        ("tests/test_sim_faults.py::test_54_days_on_16384_gpus_matches_llama3",),
    ),
    # the contract's `fourd train` and `fourd plan` promises (tests/test_contract_*.py)
    "an Adam beta of exactly 1 accepted": (
        "fourd/config.py",
        "_BETA = (lambda value: 0 <= value < 1, ",
        "_BETA = (lambda value: 0 <= value <= 1, ",
        (
            "tests/test_contract_limits.py::test_an_adam_beta_of_exactly_one_is_refused_and_0999_accepted",
        ),
    ),
    "a run of 0 steps accepted": (
        "fourd/config.py",
        '    "train.steps": _at_least(1),',
        '    "train.steps": _at_least(0),',
        ("tests/test_contract_limits.py::test_every_limit_is_the_one_written_out",),
    ),
    "memory check multiplies by the ranks on GPUs too": (
        "fourd/train/auto.py",
        'ranks, where = 1, f"{capacity / 1e9:.1f} GB per GPU"',
        'ranks, where = par.layout.world, f"{capacity / 1e9:.1f} GB per GPU"',
        (
            "tests/test_contract_limits.py::test_memory_check_multiplies_by_the_ranks_on_a_cpu_and_not_on_gpus",
        ),
    ),
    "planner's ZeRO bytes ignore HSDP's replica groups": (
        "fourd/plan/memory.py",
        "job.par.zero, job.par.shard_ranks, job.state_dtype_bytes",
        "job.par.zero, job.par.grad_ranks, job.state_dtype_bytes",
        (
            "tests/test_contract_limits.py::test_planner_shards_zero3_state_over_dp_over_the_hsdp_replicas",
        ),
    ),
    "per-op recomputation keeps the other half of the matmuls": (
        "fourd/parallel/recompute.py",
        "keep = count % 2 == 1  # the 1st",
        "keep = count % 2 == 0  # the 1st",
        ("tests/test_contract_recompute.py::test_per_op_keeps_the_bytes_the_planner_counts",),
    ),
    "planner runs cuDNN's attention on a GPU without its figures": (
        "fourd/plan/job.py",
        'if asked == "cudnn" and self.cluster.gpu.cudnn_attention_fwd_efficiency is None:',
        'if asked == "cudnn" and self.cluster.gpu.cudnn_attention_fwd_efficiency is not None:',
        (
            "tests/test_plan_stack.py::"
            "test_the_attention_kernel_is_the_stacks_and_cudnn_runs_only_where_the_gpu_has_its_figures",
        ),
    ),
    "planner's cuDNN attention takes FlashAttention-2's backward": (
        "fourd/plan/kernels.py",
        "forward, backward = gpu.cudnn_attention_fwd_efficiency, gpu.cudnn_attention_bwd_efficiency",
        "forward = gpu.cudnn_attention_fwd_efficiency",
        (
            "tests/test_plan_stack.py::"
            "test_cudnn_attention_is_faster_by_exactly_its_efficiencies_and_nothing_else_moves",
        ),
    ),
    "planner's attention runs every head dimension at head dim 128's rate": (
        "fourd/plan/kernels.py",
        "forward_share, backward_share = head_dim_share(family, head_dim)",
        "forward_share, backward_share = head_dim_share(family, 128)",
        (
            "tests/test_plan_stack.py::"
            "test_each_attention_kernel_runs_heads_of_64_at_its_measured_share_of_heads_of_128",
        ),
    ),
    "planner's bubble share floors the division": (
        "fourd/plan/search.py",
        "self.step.bubble_s / self.step.step_s",
        "self.step.bubble_s // self.step.step_s",
        ("tests/test_contract_search.py::test_the_bubble_share_is_the_bubble_over_the_step",),
    ),
    "the search leaves out CP of exactly 1,024 tokens a rank": (
        "fourd/plan/search.py",
        "seq // cp_degree >= MIN_CP_TOKENS",
        "seq // cp_degree > MIN_CP_TOKENS",
        (
            "tests/test_contract_search.py::"
            "test_context_parallelism_is_tried_down_to_1024_tokens_a_rank_and_never_below",
        ),
    ),
    "full recomputation's hardware FLOPs leave out the attention core": (
        "fourd/plan/search.py",
        '"full": sum(mm) + attention',
        '"full": sum(mm)',
        (
            "tests/test_contract_search.py::"
            "test_full_recomputation_adds_the_whole_forward_to_the_hardware_flops",
        ),
    ),
    "planner's per-op hardware FLOPs charge the kept matmuls": (
        "fourd/plan/search.py",
        '"per-op": sum(mm[1::2])',
        '"per-op": sum(mm[::2])',
        (
            "tests/test_contract_recompute.py::test_planner_counts_the_recomputed_flops_in_hardware_flops",
        ),
    ),
    "planner's per-op backward times the kept matmuls again": (
        "fourd/plan/perf.py",
        "for out_dim, k in matmuls(work)[1::2]:",
        "for out_dim, k in matmuls(work)[0::2]:",
        (
            "tests/test_contract_recompute.py::test_planner_charges_the_recomputed_matmuls_in_backward_time",
        ),
    ),
    "ZeRO 1 checkpoint leaves out the owners' exp_avg_sq": (
        "fourd/parallel/dp.py",
        'for key in ("exp_avg", "exp_avg_sq"):',
        'for key in ("exp_avg",):',
        (
            "tests/test_contract_zero1.py::test_zero1_checkpoint_restores_every_ranks_optimizer_shard_exactly",
        ),
    ),
    "CP on CUDA tiles the KV heads instead of repeating each": (
        "fourd/parallel/cp.py",
        "k_all = k_all.repeat_interleave(repeats, dim=1)\n"
        "            v_all = v_all.repeat_interleave(repeats, dim=1)",
        "k_all = k_all.repeat(1, repeats, 1, 1)\n            v_all = v_all.repeat(1, repeats, 1, 1)",
        (
            "tests/test_contract_cp_cuda_path.py::test_cp2_with_kv_heads_repeated_as_on_cuda_equals_one_process",
        ),
    ),
    "a resumed fine-tuning run loads --init-from's weights again": (
        "fourd/train/worker.py",
        "if step == 0 and t.init_from:",
        "if t.init_from:",
        (
            "tests/test_contract_train.py::test_a_resumed_fine_tuning_run_starts_from_its_checkpoint_not_from_init_from",
        ),
    ),
    "MFU on CPU ranks divides by one peak per rank": (
        "fourd/train/metrics.py",
        "        return peak_flops * ranks\n    return peak_flops\n",
        "        return peak_flops * ranks\n    return peak_flops * ranks\n",
        (
            "tests/test_train_summary.py::test_mfus_peak_is_every_gpus_or_the_one_the_cpu_ranks_share",
        ),
    ),
    "a worker leaves SIGTERM to its default (dies unsaved)": (
        "fourd/train/worker.py",
        "for stop_signal in (signal.SIGINT, signal.SIGTERM):",
        "for stop_signal in (signal.SIGINT,):",
        (
            "tests/test_contract_launch.py::test_a_worker_takes_sigint_and_sigterm_as_a_request_to_stop",
        ),
    ),
    "FP8 converts the output projection too": (
        "fourd/parallel/apply.py",
        'return isinstance(module, torch.nn.Linear) and fqn != "output"',
        "return isinstance(module, torch.nn.Linear)",
        (
            "tests/test_contract_fp8_path.py::"
            "test_fp8_converts_every_block_linear_and_keeps_the_output_projection_in_bf16",
        ),
    ),
    "no checkpoint at the last step unless it falls on the interval": (
        "fourd/train/worker.py",
        "return step == steps or bool(interval and step % interval == 0)",
        "return bool(interval and step % interval == 0)",
        ("tests/test_contract_arith.py::test_a_checkpoint_every_interval_and_at_the_last_step",),
    ),
    "the planner's training days leave out the token budget's last day": (
        "fourd/plan/search.py",
        '"training_days": train_tokens / self.tokens_per_s / 86400,',
        '"training_days": train_tokens // self.tokens_per_s // 86400,',
        ("tests/test_plan_cli.py::test_training_days_from_a_token_budget",),
    ),
    "a run directory holding only metrics is taken without --resume": (
        "fourd/train/cli.py",
        'if (d / "checkpoints").exists() or (d / "metrics.jsonl").exists():',
        'if (d / "checkpoints").exists():',
        (
            "tests/test_contract_run_dir.py::"
            "test_a_run_directory_holding_a_run_is_refused_without_resume[metrics.jsonl]",
        ),
    ),
    "validate_planner.py's signed bias by stack taken as the absolute error": (
        "benchmarks/validate_planner.py",
        'groups.setdefault(row[key], []).append(row["error"])',
        'groups.setdefault(row[key], []).append(abs(row["error"]))',
        (
            "tests/test_plan_validation.py::"
            "test_the_signed_bias_by_stack_and_generation_is_the_held_out_rows_mean",
        ),
    ),
    "validate_planner.py --json's out_of_sample_max is the best row": (
        "benchmarks/validate_planner.py",
        '"out_of_sample_max": max(abs(r["error"]) for r in held),',
        '"out_of_sample_max": min(abs(r["error"]) for r in held),',
        (
            "tests/test_plan_validation.py::test_out_of_sample_error_is_pinned_and_within_the_targets",
        ),
    ),
    "a stack's own FP32 gradient pass forgotten (only DeepSpeed's engine pays it)": (
        "fourd/plan/job.py",
        "return load_stack(self.stack).grad_accumulate_pass or engine",
        "return engine",
        (
            "tests/test_contract_perf.py::"
            "test_a_stack_that_accumulates_gradients_apart_pays_a_pass_a_microbatch",
        ),
    ),
    "FSDP2's backward reuses the forward's gathered weights under ZeRO 3 (one copy-out)": (
        "fourd/plan/perf.py",
        "backward_gathers = 1.0 if reshards else 0.0",
        "backward_gathers = 0.0 if reshards else 0.0",
        (
            "tests/test_contract_perf.py::"
            "test_fsdp2_copies_each_gathered_layer_out_and_each_gradient_in_on_the_compute_stream",
        ),
    ),
    "the input embedding's gradients hidden like a layer's (the planner)": (
        "fourd/plan/perf.py",
        "embedding_share = min(1.0, job.model.embedding_params() / lay.tp / params)",
        "embedding_share = 0.0",
        (
            "tests/test_contract_perf.py::"
            "test_the_input_embeddings_gradients_reduce_after_the_backward_that_computes_them_last",
        ),
    ),
    "the input embedding's gradients spread over the layers (the step simulator)": (
        "fourd/sim/step.py",
        "embedding = embedding_bytes if stage == 0 else 0.0",
        "embedding = 0.0",
        ("tests/test_contract_sim_step.py::test_a_bucket_of_a_third_of_a_stage_is_not_rounded",),
    ),
    "a tied output projection counted as a matrix of its own on one stage": (
        "fourd/plan/memory.py",
        "if not (model.tied_embeddings and len(counts) == 1):",
        "if True:",
        (
            "tests/test_contract_perf.py::"
            "test_a_tied_embedding_is_held_once_by_one_stage_and_synced_between_two",
        ),
    ),
    "a tied embedding's two pipeline copies never synced": (
        "fourd/plan/perf.py",
        "if not job.model.tied_embeddings or lay.pp == 1:",
        "if True:",
        (
            "tests/test_contract_perf.py::"
            "test_a_tied_embedding_is_held_once_by_one_stage_and_synced_between_two",
        ),
    ),
    "leave-source-out keeps the source's own rows in the fit": (
        "benchmarks/validate_planner.py",
        "dataclasses.replace(run, fit=False) if run.source == source else run for run in runs",
        "run for run in runs",
        (
            "tests/test_plan_validation.py::"
            "test_leave_source_out_refits_without_the_source_and_puts_the_numbers_back",
        ),
    ),
    "leave-source-out leaves the refitted constants in place": (
        "benchmarks/validate_planner.py",
        "    finally:\n        _restore(state)",
        "    finally:\n        pass",
        (
            "tests/test_plan_validation.py::"
            "test_leave_source_out_refits_without_the_source_and_puts_the_numbers_back",
        ),
    ),
    "a GPT block's LayerNorms counted without their biases": (
        "fourd/model/config.py",
        'norms = 2 * self.dim if self.mlp == "swiglu" else 4 * self.dim',
        'norms = 2 * self.dim if self.mlp == "swiglu" else 2 * self.dim',
        ("tests/test_model_llama.py::test_model_spec_parsing",),
    ),
    "metrics.jsonl logs the peak learning rate, not the scheduled one": (
        "fourd/train/worker.py",
        '"lr": lr,',
        '"lr": cfg.train.lr,',
        (
            "tests/test_contract_run.py::"
            "test_two_ranks_train_on_one_processs_tokens_and_log_every_contract_field",
        ),
    ),
    "data-parallel ranks read overlapping samples": (
        "fourd/train/worker.py",
        'self.par.coords["dp"] * self.per_dp\n',
        'self.par.coords["dp"]\n',
        (
            "tests/test_contract_run.py::"
            "test_two_ranks_train_on_one_processs_tokens_and_log_every_contract_field",
        ),
    ),
    "every data-parallel rank evaluates the same held-out windows": (
        "fourd/train/worker.py",
        "first = index * batch + self.offset",
        "first = index * batch",
        (
            "tests/test_contract_run.py::"
            "test_two_ranks_train_on_one_processs_tokens_and_log_every_contract_field",
        ),
    ),
    "config.toml leaves out the settings that are 0 or false": (
        "fourd/config.py",
        "for key, value in values.items()\n                    if value is not None",
        "for key, value in values.items()\n                    if value",
        (
            # the contract's end-to-end test (tests/test_contract_run.py) catches it too, in 14 s
            "tests/test_contract_config.py::"
            "test_the_written_configuration_reads_back_and_leaves_unset_model_keys_out",
        ),
    ),
    "the launcher never restarts a dead worker": (
        "fourd/train/launch.py",
        "kw |= dict(max_restarts=max_restarts,",
        "kw |= dict(max_restarts=0,",
        (
            "tests/test_contract_run.py::"
            "test_a_rank_killed_once_is_restarted_from_the_newest_checkpoint",
        ),
    ),
    "an injected fault kills its rank again after every restart": (
        "fourd/train/worker.py",
        "if self.attempt == 0 and step == cfg.fault.at_step:",
        "if step == cfg.fault.at_step:",
        (
            "tests/test_contract_run.py::"
            "test_a_rank_killed_once_is_restarted_from_the_newest_checkpoint",
        ),
    ),
    "--layout auto keeps the planner's layout but not its ZeRO stage": (
        "fourd/train/auto.py",
        'kept = ("schedule", "microbatches", "virtual_stages", "zero", "recompute", "sequence_parallel")',
        'kept = ("schedule", "microbatches", "virtual_stages", "recompute", "sequence_parallel")',
        (
            "tests/test_train_auto.py::test_layout_auto_sets_every_setting_of_the_planners_best_plan",
        ),
    ),
    "MFU counts the input embedding's 6 FLOPs a parameter": (
        "fourd/model/config.py",
        "model = 6 * (self.non_embedding_params() + self.embedding_params()) + attention",
        "model = 6 * (self.non_embedding_params() + 2 * self.embedding_params()) + attention",
        (
            "tests/test_contract_arith.py::"
            "test_mfu_counts_six_flops_a_parameter_but_the_input_embedding_and_twelve_l_h_q_t",
        ),
    ),
    "a run stopped by SIGINT on one rank and SIGTERM on another exits 130": (
        "fourd/train/launch.py",
        "return 128 + max(results) if max(results) else 0",
        "return 128 + min(r for r in results if r) if max(results) else 0",
        ("tests/test_contract_arith.py::test_exit_status_of_returned_workers",),
    ),
    "--train.compile=false still compiles on CUDA": (
        "fourd/parallel/apply.py",
        "if cfg.train.compile is not None:",
        "if cfg.train.compile:",
        (
            "tests/test_parallel_apply.py::"
            "test_train_compile_compiles_every_block_and_by_default_only_on_cuda",
        ),
    ),
    "Ctrl-C ends the launcher instead of stopping the workers at a step boundary": (
        "fourd/train/launch.py",
        "before = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}",
        "before = {s: signal.signal(s, stop) for s in (signal.SIGTERM,)}",
        (
            "tests/test_contract_launch.py::"
            "test_a_signal_to_the_launcher_becomes_the_workers_stop_file_and_a_second_ends_it",
        ),
    ),
    "a process with LOCAL_RANK set (Slurm, another launcher) runs as a torchrun worker": (
        "fourd/train/launch.py",
        'return "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_RANK" in os.environ',
        'return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ',
        ("tests/test_contract_launch.py::test_only_an_elastic_agents_worker_runs_as_the_worker",),
    ),
    "two runs started in the same second share a run directory": (
        "fourd/train/cli.py",
        "Path(cfg.run.dir).mkdir(parents=True)\n                break",
        "Path(cfg.run.dir).mkdir(parents=True, exist_ok=True)\n                break",
        (
            "tests/test_contract_launch.py::test_runs_without_run_dir_get_fresh_directories_under_runs",
        ),
    ),
    "fourd generate multiplies the logits by the temperature": (
        "fourd/hf/inference.py",
        "logits.double() / temperature",
        "logits.double() * temperature",
        (
            "tests/test_hf_generate.py::test_the_nucleus_is_softmax_of_the_logits_over_the_temperature",
        ),
    ),
    "fourd data verify skips each shard's document index": (
        "fourd/data/verify.py",
        '            (shard["index"], shard["documents"] * 8, shard["index_sha256"]),\n',
        "",
        (
            "tests/test_data_prepare.py::"
            "test_verify_names_a_damaged_shard_or_index_with_exit_status_2",
        ),
    ),
    "fourd plan's tokens_per_s counts sequences": (
        "fourd/plan/search.py",
        "tokens_per_s = property(lambda self: self.global_seqs * self.seq / self.step.step_s)",
        "tokens_per_s = property(lambda self: self.global_seqs / self.step.step_s)",
        ("tests/test_contract_search.py::test_a_plans_rates_and_peak_memory_by_hand",),
    ),
    "fourd plan's mfu counts the recomputed FLOPs": (
        "fourd/plan/search.py",
        "mfu = property(lambda self: self.tflops_per_gpu / self.peak_tflops)",
        "mfu = property(lambda self: self.hw_tflops_per_gpu / self.peak_tflops)",
        (
            "tests/test_contract_search.py::"
            "test_full_recomputation_adds_the_whole_forward_to_the_hardware_flops",
        ),
    ),
    "fourd plan's fits leaves out the runtime's reserve": (
        "fourd/plan/memory.py",
        "return self.total + self.reserve <= capacity",
        "return self.total <= capacity",
        (
            "tests/test_contract_memory.py::"
            "test_a_memory_adds_its_tensors_then_the_cache_and_the_reserve",
        ),
    ),
    "an open search offers schedules the stack does not run": (
        "fourd/plan/search.py",
        'better = [name for name in stack.schedules if name != "gpipe"]',
        'better = ["1f1b", "interleaved", "zero-bubble"]',
        (
            "tests/test_plan_stack.py::"
            "test_an_open_search_keeps_to_the_schedules_and_zero_stages_the_stack_runs",
        ),
    ),
    # anchored intervals: the spread and the shape (fourd.plan.intervals)
    "an anchored step time's interval ignores its spread": (
        "fourd/plan/intervals.py",
        "return self.half_width * (spread if self.anchored else 1.0)",
        "return self.half_width",
        (
            "tests/test_contract_intervals.py::"
            "test_an_anchored_interval_is_its_groups_half_width_times_its_spread",
        ),
    ),
    "the spread shrinks when the GPU-time per token falls": (
        "fourd/plan/intervals.py",
        "return (SAME if same else RESHAPED), SPREAD_FLOOR + abs(moved)",
        "return (SAME if same else RESHAPED), SPREAD_FLOOR + moved",
        (
            "tests/test_contract_intervals.py::"
            "test_the_spread_is_the_floor_plus_how_far_the_gpu_time_per_token_moves",
        ),
    ),
    "anchored residuals ranked without their spreads": (
        "fourd/plan/intervals.py",
        'row["residual"] / row.get("spread", 1.0)',
        'row["residual"]',
        (
            "tests/test_contract_intervals.py::"
            "test_groups_rank_anchored_residuals_over_their_spreads_and_keep_the_shape",
        ),
    ),
    "reshaped and same-shape anchored rows pooled": (
        "fourd/plan/intervals.py",
        'True: (KEYS, ("stack", "scale", "shape"), ("stack", "shape"), ("shape",)),',
        'True: (KEYS, ("stack", "scale", "shape"), ("stack", "shape"), ()),',
        (
            "tests/test_contract_intervals.py::"
            "test_groups_rank_anchored_residuals_over_their_spreads_and_keep_the_shape",
        ),
    ),
    # NCCL's latencies, DDP's buckets, nanotron's split and GPT-2's gelu_new (2026-12-06)
    "a ring's steps between servers at NVLink's latency": (
        "fourd/plan/cluster.py",
        "steps, crossing = group.size - 1, servers - 1",
        "steps, crossing = group.size - 1, 0",
        (
            "tests/test_contract_kernels.py::"
            "test_a_collective_across_servers_pays_the_networks_latency_on_the_steps_between_them",
        ),
    ),
    "DDP's buckets filled with FP32 gradients whatever the weights": (
        "fourd/plan/job.py",
        "return bucket_mb * 2**20 / self.state_dtype_bytes",
        "return bucket_mb * 2**20 / 4",
        (
            "tests/test_plan_stack.py::"
            "test_a_stacks_gradient_buckets_are_collective_calls_and_the_embeddings_are_exposed",
        ),
    ),
    "nanotron's split hands over at its share, not past it": (
        "fourd/plan/job.py",
        "if cumulative > thresholds[rank]:",
        "if cumulative >= thresholds[rank]:",
        (
            "tests/test_plan_model.py::"
            "test_nanotrons_split_balances_the_layers_and_the_output_layer_by_their_cost",
        ),
    ),
    "gelu_new's backward one FP32 op short": (
        "fourd/plan/block.py",
        "backward = 9 * b + 19 * s",
        "backward = 9 * b + 17 * s",
        ("tests/test_contract_block.py::test_eager_gelu_new_moves_and_keeps_the_counted_bytes",),
    ),
    "the step simulator drops the gradients a last DDP bucket would hold": (
        "fourd/sim/step.py",
        "while self.pending >= self.capacity or (last and self.pending > 0):",
        "while self.pending >= self.capacity:",
        (
            "tests/test_contract_sim_step.py::"
            "test_a_ddp_stack_reduces_its_gradients_in_buckets_as_the_backward_fills_them",
        ),
    ),
    # a cluster's network fitted to nccl-tests (2026-12-06)
    "the network fit keeps collectives inside one server": (
        "fourd/plan/netfit.py",
        '    if sample.nodes == 1:\n        return "on one server"',
        '    if sample.nodes == 0:\n        return "on one server"',
        ("tests/test_plan_netfit.py::test_single_server_and_small_messages_are_left_out",),
    ),
    "the network fit stops at its coarse grid": (
        "fourd/plan/netfit.py",
        "    _, latency, efficiency = best(fine_latencies, fine_efficiencies)\n",
        "",
        ("tests/test_plan_netfit.py::test_the_aws_p5_preset_is_the_fit_of_the_measured_p5_rows",),
    ),
    "the fitted profile renames its GPU too": (
        "fourd/plan/netfit.py",
        "if index < first_table and re.match(",
        "if re.match(",
        ("tests/test_plan_netfit.py::test_calibrate_writes_the_profile_with_the_fitted_network",),
    ),
    # measuring on a machine whose speed drifts: rounds and medians
    "calibrate's rounds keep the first round's figures": (
        "fourd/measure/calibrate.py",
        "        return statistics.median(rounds)\n",
        "        return rounds[0]\n",
        (
            "tests/test_comm_calibrate.py::"
            "test_rounds_keep_each_measured_figure_s_median_and_what_is_read_once",
        ),
    ),
    "CPU sync waits charged to pipeline stages that take turns on the cores": (
        "fourd/plan/perf.py",
        "if ranks > slots and job.layout.pp > 1:",
        "if ranks > slots and job.layout.pp > 2:",
        (
            "tests/test_contract_perf.py::"
            "test_cpu_workers_lose_their_measured_sync_share_unless_a_pipeline_stage_takes_the_core",
        ),
    ),
    "CPU sync waits dropped with more ranks than cores": (
        "fourd/plan/perf.py",
        "if ranks > slots and job.layout.pp > 1:",
        "if ranks > slots:",
        (
            "tests/test_contract_perf.py::"
            "test_cpu_workers_lose_their_measured_sync_share_unless_a_pipeline_stage_takes_the_core",
        ),
    ),
    "CPU sync waits of TP's pattern charged to every layout": (
        "fourd/plan/perf.py",
        "share = cluster.node.sync_share if job.layout.tp > 1 else cluster.node.layer_sync_share",
        "share = cluster.node.sync_share",
        (
            "tests/test_contract_perf.py::"
            "test_cpu_workers_lose_their_measured_sync_share_unless_a_pipeline_stage_takes_the_core",
        ),
    ),
    "Megatron-LM's interleaved exchanges waited for as 1F1B's": (
        "fourd/plan/job.py",
        'return "overlapped" if interleaved else "synchronous"',
        'return "synchronous"',
        ("tests/test_contract_perf.py::test_a_steps_pipeline_sends_by_how_the_stack_exchanges",),
    ),
    "an anchored target takes the anchor's virtual stages at any pipeline depth": (
        "fourd/plan/anchor.py",
        'if depth == measured_depth and schedule == measured.get("schedule") and open_stages:',
        'if schedule == measured.get("schedule") and open_stages:',
        ("tests/test_plan_anchor.py::test_a_target_pipeline_runs_as_the_anchor_ran",),
    ),
    "an anchored target's schedule left to the search": (
        "fourd/plan/anchor.py",
        'if target.get("schedule") is None and measured.get("schedule"):',
        "if False:",
        ("tests/test_plan_anchor.py::test_a_target_pipeline_runs_as_the_anchor_ran",),
    ),
    "FP8 GEMMs at the BF16 peak": (
        "fourd/plan/kernels.py",
        "    compute = flops / (gpu.fp8_peak_tflops * 1e12 * gpu.gemm_efficiency * share * util)\n",
        "    compute = flops / (gpu.peak_tflops * 1e12 * gpu.gemm_efficiency * share * util)\n",
        ("tests/test_plan_fp8.py::test_an_fp8_gemm_follows_the_documented_formula",),
    ),
    "FP8's output gradients cast without their transposes": (
        "fourd/plan/block.py",
        "    gradients = 4 * ((dims.q + 2 * dims.kv) + 2 * dims.h + (2 if gated else 1) * dims.f)\n",
        "    gradients = 3 * ((dims.q + 2 * dims.kv) + 2 * dims.h + (2 if gated else 1) * dims.f)\n",
        ("tests/test_plan_fp8.py::test_the_casts_fp8_adds_are_counted_by_hand",),
    ),
    "the search's ranking stops at its first plans timed, floors unread": (
        "fourd/plan/search.py",
        "        if len(fastest) == top and ceiling < fastest[0]:\n",
        "        if len(fastest) == top:\n",
        (
            "tests/test_contract_search.py::"
            "test_the_ranking_of_the_top_plans_is_the_full_searchs_first[debug-cpu]",
        ),
    ),
    "FP8 copies the weights ZeRO 3 shards": (
        "fourd/plan/memory.py",
        "    if work.fp8 and job.par.zero < 3:\n",
        "    if work.fp8:\n",
        (
            "tests/test_plan_fp8.py::test_fp8_keeps_whole_weights_twice_more_in_one_byte_and_linear_inputs_in_one",
        ),
    ),
    "a stack's BF16 gradient reductions move FP32's bytes": (
        "fourd/plan/job.py",
        "        return GRAD_REDUCE_BYTES[load_stack(self.stack).grad_reduce]\n",
        "        return 4\n",
        (
            "tests/test_plan_stack.py::"
            "test_a_stack_reducing_bf16_gradients_moves_half_the_gradient_bytes",
        ),
    ),
    "FP8's sequence-parallel all-gathers move BF16's bytes": (
        "fourd/plan/perf.py",
        "    gather_bytes = 1 if work.fp8 else work.dtype_bytes\n",
        "    gather_bytes = work.dtype_bytes\n",
        (
            "tests/test_plan_fp8.py::"
            "test_fp8_gathers_the_sequence_parallel_activations_in_one_byte_and_reduces_in_two",
        ),
    ),
    "Megatron's main_grad buffer held in the weights' bytes": (
        "fourd/plan/job.py",
        "        if load_stack(self.stack).main_grads:\n            return self.grad_reduce_bytes\n",
        "        if load_stack(self.stack).main_grads:\n            return weights\n",
        ("tests/test_contract_memory.py::test_each_stack_holds_its_gradients_in_its_own_bytes",),
    ),
    "a hybrid ZeRO's gradients reduce-scattered whatever the stack": (
        "fourd/plan/perf.py",
        "        if job.reduces_whole_gradients:\n",
        "        if False:\n",
        (
            "tests/test_plan_stack.py::"
            "test_a_hybrid_zero_all_reduces_the_gradients_and_broadcasts_each_ranks_shard",
        ),
    ),
    "weights broadcast rank by rank pay one broadcast's latency": (
        "fourd/plan/perf.py",
        '        return shard.size * collective_time("broadcast", nbytes / shard.size, shard, job.cluster)\n',
        '        return collective_time("broadcast", nbytes, shard, job.cluster)\n',
        (
            "tests/test_plan_stack.py::"
            "test_a_hybrid_zero_all_reduces_the_gradients_and_broadcasts_each_ranks_shard",
        ),
    ),
    "the mean over sources weighs each row, not each source": (
        "benchmarks/validate_planner.py",
        '        "out_of_sample_source_mean": statistics.mean(source_means.values()),\n',
        '        "out_of_sample_source_mean": statistics.mean(abs(r["error"]) for r in held),\n',
        (
            "tests/test_plan_validation.py::"
            "test_the_signed_bias_by_stack_and_generation_is_the_held_out_rows_mean",
        ),
    ),
    "the first FlashAttention and FlashAttention in Triton at FlashAttention-2's rates": (
        "fourd/plan/kernels.py",
        "    family_forward, family_backward = FAMILY_SHARES.get(kernel, (1.0, 1.0))\n",
        "    family_forward, family_backward = 1.0, 1.0\n",
        (
            "tests/test_plan_stack.py::test_the_first_flashattention_runs_at_half_flashattention_2s_rate",
            "tests/test_plan_stack.py::"
            "test_flashattention_in_triton_runs_forward_at_1_over_1_4_and_backward_at_half",
        ),
    ),
    "FlashAttention in Triton's backward at its forward's share": (
        "fourd/plan/kernels.py",
        "TRITON_SHARE = (1 / 1.4, 1 / 2)\n",
        "TRITON_SHARE = (1 / 1.4, 1 / 1.4)\n",
        (
            "tests/test_plan_stack.py::"
            "test_flashattention_in_triton_runs_forward_at_1_over_1_4_and_backward_at_half",
        ),
    ),
    "HSDP's shards never all-reduced across the replica groups": (
        "fourd/plan/perf.py",
        "            across = _across_replicas(job, grad_bytes * params / shard.size, reductions)\n",
        "            across = 0.0\n",
        (
            "tests/test_plan_stack.py::"
            "test_zero_1_within_replica_groups_reduces_in_each_group_and_across_them",
        ),
    ),
    "the search ranks a plan that empties the allocator's cache with those that keep it": (
        "fourd/plan/search.py",
        "    return (plan.room, -plan.tokens_per_s if plan.fits else plan.memory.total)\n",
        "    return (not plan.fits, -plan.tokens_per_s if plan.fits else plan.memory.total)\n",
        (
            "tests/test_plan_report.py::"
            "test_plans_that_keep_the_allocators_cache_rank_before_faster_ones_that_empty_it",
        ),
    ),
    "a pipeline fills and drains at its slowest rank's pace": (
        "fourd/plan/perf.py",
        "    gap = StageTime(slowest - others, 0.0, 0.0, 0.0, 0.0)\n",
        "    gap = StageTime(0.0, 0.0, 0.0, 0.0, 0.0)\n",
        (
            "tests/test_contract_perf.py::"
            "test_a_1f1b_pipeline_fills_and_drains_through_the_faster_ranks_as_the_events_do",
        ),
    ),
    "plan_vs_measured keeps a layout's last round": (
        "benchmarks/plan_vs_measured.py",
        "    median = statistics.median(times)\n",
        "    median = times[-1]\n",
        (
            "tests/test_bench_plan_vs_measured.py::"
            "test_a_layouts_rounds_are_judged_by_their_median_and_its_nearest_round",
        ),
    ),
    "Megatron's selective recomputation redoes nothing beside a fused attention kernel": (
        "fourd/plan/job.py",
        'return self.attention != "flash" or self.selective == "attention"',
        'return self.attention != "flash"',
        (
            "tests/test_plan_stack.py::"
            "test_megatrons_selective_recomputation_runs_the_fused_attention_kernel_again",
        ),
    ),
    "the lab's helper leaves its ended children as zombies": (
        "fourd/lab/forker.py",
        "    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the children\n",
        "    pass\n",
        (
            "tests/test_lab_server.py::"
            "test_a_request_computing_longer_than_the_bound_is_refused_and_its_work_ended",
        ),
    ),
    "the plan report calls an overlapped TP share not overlapped": (
        "fourd/plan/report.py",
        "    if plan.job.work.tp_overlap:\n",
        "    if False:\n",
        ("tests/test_plan_report.py::test_tp_overlap_names_what_it_leaves_exposed",),
    ),
    "the plan report's attention seconds leave out the recomputed forward": (
        "fourd/plan/report.py",
        "        backward += forward\n",
        "        pass\n",
        (
            "tests/test_plan_report.py::"
            "test_long_sequences_say_what_attention_takes_and_short_ones_do_not",
        ),
    ),
    "a GB200 is planned as a B200 (its name holds B200)": (
        "fourd/train/auto.py",
        '    "GB200": "dgx-gb200",\n    "B200": "dgx-b200",',
        '    "B200": "dgx-b200",\n    "GB200": "dgx-gb200",',
        ("tests/test_train_auto.py::test_a_gpu_plans_on_the_preset_its_cuda_name_holds",),
    ),
    "an H800 is planned with an H100's NVLink": (
        "fourd/plan/clusters/hgx-h800.toml",
        "intra_bw_gbps = 200.0 ",
        "intra_bw_gbps = 450.0 ",
        ("tests/test_train_auto.py::test_a_gpu_plans_on_the_preset_its_cuda_name_holds",),
    ),
    "an H800's intervals are looked up among its own few rows, not its die's": (
        "fourd/plan/intervals.py",
        ', "H800": "H100"}',
        "}",
        (
            "tests/test_contract_intervals.py::"
            "test_an_h200_is_looked_up_as_an_h100_and_other_chips_as_themselves",
        ),
    ),
    "the forward's FP8 GEMMs are charged the backward's split accumulation": (
        "fourd/plan/kernels.py",
        "    share = gpu.fp8_gemm_share if split_accumulator else 1.0\n",
        "    share = gpu.fp8_gemm_share\n",
        (
            "tests/test_plan_fp8.py::"
            "test_the_backwards_fp8_gemms_run_at_the_measured_share_and_the_forwards_at_bf16s",
        ),
    ),
    "an anchored plan's unanchored step is its anchored one": (
        "fourd/plan/anchor.py",
        "    return evaluate(plan.job).step.step_s\n",
        "    return plan.step.step_s\n",
        ("tests/test_plan_anchor.py::test_a_second_configuration_follows_the_documented_formula",),
    ),
}


# What each test run needs loaded, imported once in the server that forks the runs: each then starts in well under
# a second instead of paying for torch's import again. fourd itself is never imported there.
PRELOAD = [
    "numpy",
    "torch",
    "torch.distributed.tensor",
    "torch.distributed.pipelining",
    "pytest",
    "hypothesis",
]
PRELOAD += ["transformers"]  # the HF conversion test's
# pytest's plugins that register themselves by entry point: imported once here, not in every run
PRELOAD += ["xdist.plugin", "xdist.looponfail", "pytest_timeout", "_hypothesis_pytestplugin"]
PRELOAD += ["anyio.pytest_plugin"]
# Each run ends in os._exit: pytest's two garbage collections at exit (its unraisable-exception
# plugin's, 0.45 s with torch loaded) buy nothing there.
RUN_OPTIONS = ["-q", "-p", "no:cacheprovider", "-p", "no:unraisableexception"]
RUN_OPTIONS += ["-W", "ignore::pytest.PytestAssertRewriteWarning"]  # the modules preloaded above


WORKERS = 2  # the mutants run two at a time, each in its own copy (this machine has two cores)


def _in_copy(copy: str, args: list[str], log: str) -> None:
    """A forked run: pytest with `args` with the copy as working directory and first on the path."""
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.chdir(copy)
    # no bytecode: a mutated file and its restored original may share a size and a modification second
    os.environ.update(PYTHONPATH=copy, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    sys.dont_write_bytecode = True
    sys.path[:] = [copy] + [
        p for p in sys.path if p not in ("", ".", str(ROOT), str(ROOT / "tests"))
    ]
    import fourd

    if Path(fourd.__file__) != Path(copy, "fourd", "__init__.py"):
        print(f"the run imports fourd from {fourd.__file__}, not from the copy {copy}", flush=True)
        os._exit(99)
    code = pytest.main([*RUN_OPTIONS, *args])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code))


def _pytest(copy: Path, args) -> tuple[int, str, float]:
    """(pytest's exit status, its output, seconds) of pytest with `args` run in `copy` in a fresh process."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    log = copy.parent / f"{copy.name}.log"
    start = time.perf_counter()
    run = ctx.Process(target=_in_copy, args=(str(copy), list(args), str(log)))
    run.start()
    run.join(timeout=900)  # a loaded machine: the control runs every named test
    if run.is_alive():
        run.kill()
        run.join()
    return (
        run.exitcode if run.exitcode is not None else -1,
        log.read_text(),
        time.perf_counter() - start,
    )


def test_every_anchor_occurs_once_and_every_named_test_exists():
    """Part of `make test` (it takes no time): a refactor or a renamed test shows up there, by name."""
    for name, (path, old, new, tests) in MUTATIONS.items():
        count = (ROOT / path).read_text().count(old)
        assert count == 1, (
            f"mutation {name!r}: {path} holds its anchor {old!r} {count} times, not once: update it"
        )
        assert old != new, name
        for test in tests:
            file, _, function = test.partition("::")
            where = ROOT / file
            assert where.is_file() and f"def {function.split('[')[0]}(" in where.read_text(), (
                f"{name!r}: no {test}"
            )


def _copy(root: Path) -> Path:
    """The repository's source and tests in the fresh folder `root`."""
    for name in COPIED:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(
                source, root / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
            )
        else:
            shutil.copy2(source, root / name)
    return root


def _caught(copy: Path, name: str) -> tuple[int, str, float]:
    """The mutation `name` applied to `copy`, its named tests run there (stopping at the first failure),
    the source restored: (pytest's exit status, its output, seconds)."""
    path, old, new, tests = MUTATIONS[name]
    source = copy / path
    original = source.read_text()
    assert original.count(old) == 1, f"mutation {name!r}: its anchor is not once in {path}"
    source.write_text(original.replace(old, new))
    try:
        return _pytest(copy, ["-x", *tests])
    finally:
        source.write_text(original)


@pytest.mark.mutation
@pytest.mark.timeout(1800)
def test_every_mutation_is_caught(tmp_path_factory):
    """A control first runs every named test on an unmutated copy (two pytest workers): a test that fails
    anyway catches nothing. Then each mutation is applied to one of WORKERS copies, two at a time, and its
    named tests must fail there: exit status 1 (2-5, a collection or usage error or no test, would mean a
    broken suite, not a catch)."""
    copies: queue.Queue[Path] = queue.Queue()
    for worker in range(WORKERS):
        copies.put(_copy(tmp_path_factory.mktemp(f"mutant{worker}")))
    control = copies.get()
    named = sorted({test for *_, tests in MUTATIONS.values() for test in tests})
    code, out, seconds = _pytest(control, ["-n", str(WORKERS), "--dist", "loadgroup", *named])
    assert code == 0, f"control: the named tests fail on the unmutated copy:\n{out[-3000:]}"
    print(f"\ncontrol: {len(named)} named tests pass unmutated ({seconds:.0f} s)", flush=True)
    copies.put(control)

    def run(name: str) -> tuple[str, int, str, float]:
        copy = copies.get()
        try:
            return (name, *_caught(copy, name))
        finally:
            copies.put(copy)

    missed = []
    with concurrent.futures.ThreadPoolExecutor(WORKERS) as pool:
        for name, code, out, seconds in pool.map(run, MUTATIONS):
            path, _, _, tests = MUTATIONS[name]
            if code == 1:
                print(
                    f"caught: {name} ({path}) by {', '.join(tests)} in {seconds:.0f} s", flush=True
                )
            else:
                missed.append(
                    f"{name!r} NOT caught by {', '.join(tests)} (pytest exit {code}):\n{out[-3000:]}"
                )
    assert not missed, "\n\n".join(missed)
    print(f"{len(MUTATIONS)} mutations, each caught", flush=True)
