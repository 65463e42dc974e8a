"""Every row of the README's feature and flag tables has a served test (ARCHITECTURE.md §4.7).

`COVERAGE` maps each row (its first cell, verbatim) of the README tables named in `TABLES` to the
tests that show its effect through the real `scripts/serve.py` process. The check, both ways:
1. every row of those tables is a key, and every key is still a row (a renamed row fails);
2. every named test exists (`file.py::function`), in a file that starts `scripts/serve.py`;
3. every `scripts/serve.py` flag appears in a row of the flag table.
Rows no served test can reach yet are in `NOT_SERVED` with the reason and the tests they have.
Adding a README row: add it here with its served test (one dict entry).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.script_utils import script

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
# README tables (by their first header cell) whose rows are served features.
TABLES = ("flag", "runtime", "format", "dtype")
# A test file counts as served when it starts the real server through one of these.
SERVED_MARKERS = ("ServedProcess(", "serve_tiny(", "serve_fake(", "scripts/serve.py", "SERVE")

F = "test_served_features.py::"
E = "test_served_engine_flags.py::"
M = "test_served_mesh_quant.py::"
GREEDY = F + "test_greedy_tokens_are_the_models_on_both_protocols"
FLAGS = E + "test_the_flags_reach_the_engine_core"
BUDGETS = F + "test_budgets_and_limits_reach_the_engine"
FP8_MESH = M + "test_fp8_bf16_on_a_data_pipeline_tensor_mesh_decodes_the_models_tokens"
NGRAM = M + "test_ngram_speculation_with_fp8_kv_and_int4_on_an_expert_tensor_mesh"
INT4_CPU = M + "test_int4_on_the_cpu_kernel_decodes_the_models_tokens"
INT8_DRAFT = E + "test_int8_with_a_saved_draft_model_decodes_the_models_tokens"
TOOLS = "test_served_tools.py::"
MOE = "test_served_moe.py::test_deepseek_moe_on_an_expert_mesh_decodes_transformers_tokens"
FIELDS = "test_served_requests.py::"
PRIORITY = E + "test_priority_reorders_under_contention_and_max_queue_refuses"
MULTI_STEP = (
    "test_served_multi_step.py::test_greedy_streams_take_a_quarter_of_the_steps",
    "test_served_multi_step.py::test_stops_end_the_stream_on_the_same_token",
    "test_served_multi_step.py::test_concurrent_streams_and_a_logprobs_one_are_exact",
)

COVERAGE: dict[str, tuple[str, ...]] = {
    # serve.py flags
    "`--model`": (GREEDY, "test_served_default.py::test_default_model_answers_on_both_protocols"),
    "`--host`, `--port`": (GREEDY,),
    "`--metrics-port` / `--no-metrics`": (
        F + "test_service_health_reflection_and_metrics",
        FLAGS,
    ),
    "`--http-port`, `--http-host`": (F + "test_request_id_echoed_and_model_name_served",),
    "`--served-model-name`": (F + "test_request_id_echoed_and_model_name_served",),
    "`--load-format`": ("test_served_requests.py::test_openai_json_schema",),
    "`--skip-tokenizer-init`": (NGRAM,),
    "`--no-warmup`": (GREEDY,),
    "`--log-interval`": (F + "test_log_interval_spaces_the_load_lines",),
    "`--dtype`": (FP8_MESH,),
    "`--quantization`": (INT8_DRAFT, FP8_MESH),
    "`--kv-cache-dtype`": (NGRAM,),
    "`--page-size`, `--num-pages` / `--kv-cache-memory`": (FLAGS, BUDGETS),
    "`--max-num-seqs`, `--max-num-batched-tokens`": (BUDGETS, PRIORITY),
    "`--token-buckets`": (F + "test_token_buckets_bound_the_compiled_programs",),
    "`--long-prefill-token-threshold`": (E + "test_long_prefill_threshold_splits_the_prompt",),
    "`--max-model-len`": (BUDGETS,),
    "`--mesh`": (FP8_MESH, NGRAM),
    "`--coordinator-address`, `--num-processes`, `--process-id`": (
        "test_multihost.py::test_serve_script_two_processes_sigterm_stops_both",
        "test_served_ops.py::test_leaderworkerset_env_names_the_multihost_flags",
    ),
    "`--attention-backend`": (FLAGS,),
    "`--linear-backend`": (FLAGS,),
    "`--no-prefix-caching`": (FLAGS, E + "test_no_prefix_caching_caches_nothing"),
    "`--no-async-scheduling`": (FLAGS,),
    "`--speculative-config`": (INT8_DRAFT, NGRAM),
    "`--num-scheduler-steps`": MULTI_STEP,
    "`--max-queue`": (PRIORITY,),
    "`--max-request-bytes`": (
        "test_served_lifeline.py::test_content_length_over_the_cap_is_413_before_the_body_is_sent",
        "test_served_lifeline.py::test_grpc_message_over_the_cap_is_resource_exhausted",
    ),
    "`--max-num-encoder-input-tokens`": (
        "test_served_vision.py::test_two_images_take_one_encoder_budget_each",
    ),
    "`--limit-mm-per-prompt`": ("test_served_vision.py::test_limit_mm_per_prompt",),
    "`--allowed-local-media-path`": (
        "test_served_vision.py::test_image_urls_from_files_and_hosts_are_the_same_image",
        "test_served_vision.py::test_refused_and_failed_image_urls_are_a_400_naming_the_part",
    ),
    "`--allowed-media-domains`": (
        "test_served_vision.py::test_refused_and_failed_image_urls_are_a_400_naming_the_part",
        "test_served_vision.py::test_a_slow_image_host_holds_no_other_client_then_times_out",
    ),
    "`--max-image-bytes`": (
        "test_served_vision.py::test_refused_and_failed_image_urls_are_a_400_naming_the_part",
    ),
    "`--grace-period`": (
        M + "test_grace_period_aborts_what_is_left",
        E + "test_sigterm_drains_with_503_and_a_second_sigterm_aborts_at_once",
    ),
    "`--profile-port`, `--trace-dir` + `--trace-steps`": (
        M + "test_engine_in_process_and_profile_port",
        E + "test_trace_dir_is_written_by_the_engine_core",
        "test_served_profile.py::test_step_markers_and_annotations",
    ),
    "`--compilation-cache-dir` / `--no-compilation-cache`": (
        "test_compile_cache.py::test_restart_reads_every_program",
        "test_served_lifeline.py::test_no_profile_endpoints_without_trace_dir",
    ),
    "`--kv-events-config`": (
        "test_served_ops.py::test_kv_events_stored_on_prefill_removed_on_eviction",
    ),
    "`--engine-in-process`": (M + "test_engine_in_process_and_profile_port",),
    "`--fake-runner`, `--fake-step-delay`": (
        "test_http_server.py::test_serve_script_serves_both_protocols_over_one_front_end",
    ),
    "`--enable-auto-tool-choice`": (TOOLS + "test_auto_parses_the_hermes_format",),
    "`--tool-call-parser`": (
        TOOLS + "test_auto_parses_the_hermes_format",
        "test_served_tool_parsers.py::test_auto_parses_the_models_own_format",
    ),
    "`--reasoning-parser`": (TOOLS + "test_reasoning_content_whole_and_streamed",),
    "`--scheduling-policy`": (FIELDS + "test_priority_runs_the_urgent_request_first",),
    "`--api-key`": (FIELDS + "test_api_key_on_both_protocols",),
    "`--fake-poison-token`": (
        "test_served_isolation.py::test_three_unexplained_failures_break_the_engine_and_the_server_says_so",
        "test_served_isolation.py::test_a_poisoned_request_fails_alone_beside_eight_streams",
    ),
    # runtime / features
    "single device (CPU, GPU, TPU)": (GREEDY,),
    "tensor parallelism (`tensor=N`)": (FP8_MESH, NGRAM),
    "data parallelism (`data=N`, with `tensor`)": (FP8_MESH,),
    "pipeline parallelism (`pipeline=S`, with the other axes)": (FP8_MESH,),
    "expert parallelism (`expert=N`, MoE models)": (MOE, NGRAM),
    "MLA attention (DeepSeek)": (MOE,),
    "multi-host (`--coordinator-address --num-processes --process-id`)": (
        "test_multihost.py::test_serve_script_two_processes_sigterm_stops_both",
    ),
    "attention backend `cpu` (default on CPU)": (GREEDY,),
    "attention backend `reference`": (FLAGS,),
    "linear backend `cpu` (default on CPU)": (GREEDY, INT4_CPU),
    "`skip_tokenizer_init=True` (`LLM`, `load_model`; `serve.py --skip-tokenizer-init`)": (NGRAM,),
    "async scheduling (default on one process)": (GREEDY,),
    "multi-step scheduling (`num_scheduler_steps`, `--num-scheduler-steps`)": MULTI_STEP,
    "gRPC `Generate` service, health, reflection, Prometheus metrics": (
        F + "test_service_health_reflection_and_metrics",
        "test_served_ops.py::test_vllm_metrics_named_typed_and_counted",
    ),
    "OpenAI-compatible HTTP API (`--http-port`: completions, chat, SSE streaming, models, health, metrics)": (
        F + "test_n_streams_and_usage",
        F + "test_chat_on_both_protocols_and_its_template_kwargs",
        F + "test_request_id_echoed_and_model_name_served",
    ),
    "images in, text out (Gemma 3 `Gemma3ForConditionalGeneration`, Qwen2.5-VL `Qwen2_5_VLForConditionalGeneration`; chat `image_url` parts with `data:`, `file://` and `http(s)://` URLs, gRPC image bytes or URLs, `LLM.generate` `multi_modal_data`)": (
        "test_served_vision.py::test_chat_with_an_image_streams",
        "test_served_vision.py::test_prefix_cache_keys_include_the_image",
        "test_served_vision.py::test_image_urls_from_files_and_hosts_are_the_same_image",
        "test_served_vision.py::test_grpc_images_field",
        "test_served_qwen_vl.py::test_chat_with_an_image_streams_and_caches_by_image",
    ),
    "structured output (JSON schema, JSON object, regex, choice, Lark / GBNF grammar)": (
        "test_served_requests.py::test_openai_json_schema",
        "test_served_requests.py::test_grpc_structured_outputs",
    ),
    "tool calling (`tools`, `tool_choice` auto / required / named / none; parsers `hermes`, `llama3_json`, `mistral`) and reasoning output (`--reasoning-parser deepseek_r1` / `qwen3`)": (
        TOOLS + "test_required_calls_validate",
        TOOLS + "test_named_call_validates_whole_and_streamed",
        TOOLS + "test_reasoning_content_whole_and_streamed",
    ),
    "vLLM request fields (`logit_bias`, `allowed_token_ids`, `bad_words`, `echo` + prompt logprobs incl. `max_tokens=0`, `prompt_logprobs`, `include_stop_str_in_output`, `skip_special_tokens`, `truncate_prompt_tokens`, `return_tokens_as_token_ids`, `guided_*`; unknown fields refused)": (
        FIELDS + "test_echo_logprobs_max_tokens_0_scores_the_prompt",
        FIELDS + "test_logit_bias_allowed_token_ids_and_bad_words",
        FIELDS + "test_include_stop_str_and_guided_choice",
        FIELDS + "test_unknown_field_and_endpoints",
    ),
    "`cache_salt` prefix-cache isolation, `--scheduling-policy priority`, `--api-key`": (
        FIELDS + "test_cache_salt_isolates_prefix_cache",
        FIELDS + "test_grpc_fields_and_cache_salt",
        FIELDS + "test_priority_runs_the_urgent_request_first",
        FIELDS + "test_api_key_on_both_protocols",
    ),
    # quantization
    '`quantization="int8"`': (INT8_DRAFT,),
    '`quantization="int4"` (`int4-g32`, `int4-sym`, ...)': (NGRAM, INT4_CPU),
    '`quantization="fp8"`': (FP8_MESH,),
    '`kv_cache_dtype="fp8"`': (NGRAM,),
    "`--enable-lora`, `--lora-modules NAME=PATH ...`, `--max-loras`, `--max-lora-rank`, `--max-cpu-loras`": (
        "test_served_lora.py::test_adapters_served_listed_loaded_and_unloaded",
    ),
    "multi-LoRA (`LLM(enable_lora=True, max_loras=N, max_lora_rank=R, max_cpu_loras=M)`, `LoRARequest`; served adapters as OpenAI model ids)": (
        "test_served_lora.py::test_adapters_served_listed_loaded_and_unloaded",
        "test_served_lora.py::test_lora_metrics",
        "test_served_lora.py::test_grpc_lora_name",
    ),
    # dtypes
    "float32": (GREEDY,),
    "bfloat16": (FP8_MESH,),
}

# Rows with no served test yet: (why, the tests they do have).
NOT_SERVED: dict[str, tuple[str, tuple[str, ...]]] = {
    "attention backends `gpu` (Pallas/Triton, default on GPU), `tpu` (Pallas/Mosaic, default on TPU)": (
        "on the CPU they run in Pallas interpret mode, minutes per served step program",
        ("test_kernels.py",),
    ),
}


def readme_rows() -> list[str]:
    """First cells of the rows of the README tables named in TABLES."""
    rows: list[str] = []
    lines = (ROOT / "README.md").read_text().splitlines()
    for i, line in enumerate(lines):
        if not (line.startswith("| ") and i + 1 < len(lines) and lines[i + 1].startswith("| ---")):
            continue
        if line.split("|")[1].strip() not in TABLES:
            continue
        for row in lines[i + 2 :]:
            if not row.startswith("|"):
                break
            rows.append(re.split(r"(?<!\\)\|", row)[1].strip())
    return rows


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}


def test_every_readme_row_has_a_served_test():
    rows = readme_rows()
    assert len(rows) > 40, "the README tables were not found"
    covered = set(COVERAGE) | set(NOT_SERVED)
    missing = [r for r in rows if r not in covered]
    stale = sorted(covered - set(rows))
    assert not missing, f"README rows with no served test (add them to COVERAGE): {missing}"
    assert not stale, f"COVERAGE keys that are no README row any more: {stale}"
    assert not set(COVERAGE) & set(NOT_SERVED)


def test_every_named_test_exists_and_is_served():
    for row, tests in [*COVERAGE.items(), *((r, t) for r, (_, t) in NOT_SERVED.items())]:
        assert tests, row
        for ref in tests:
            file, _, name = ref.partition("::")
            path = TESTS / file
            assert path.is_file(), f"{row}: {file} does not exist"
            if name:
                assert name in _test_names(path), f"{row}: {ref} does not exist"
            if row in COVERAGE:
                source = path.read_text()
                assert any(m in source for m in SERVED_MARKERS), f"{row}: {file} serves nothing"


def test_every_serve_flag_has_a_readme_row():
    serve = script("serve")
    flags = {
        o
        for a in serve.build_parser()._actions  # noqa: SLF001 - argparse has no public list
        for o in a.option_strings
        if o.startswith("--") and o != "--help"
    }
    documented = set(re.findall(r"`(--[a-z0-9-]+)", " ".join(readme_rows())))
    assert not flags - documented, (
        f"serve.py flags with no README row: {sorted(flags - documented)}"
    )
