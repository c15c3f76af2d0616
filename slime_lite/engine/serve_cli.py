"""``slime-lite serve``: the embedded engine's HTTP server from the shell, with SGLang's launch flags (those the
embedded engine has; unknown ones are refused by name)."""

from __future__ import annotations

import argparse
import logging

from slime_lite.engine.server import MAX_REQUEST_BYTES, EngineServer
from slime_lite.engine_client import api_key
from slime_lite.errors import SlimeLiteError, run_main
from slime_lite.logging_setup import LOG_LEVELS, setup_logging
from slime_lite.model_families import supported

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="slime-lite serve", description="Start the embedded SGLang-compatible engine.")
    p.add_argument("--model-path", required=True, help=f"Hugging Face model folder, of a family the engine serves: {supported()}")
    p.add_argument("--tokenizer-path", default=None, help="tokenizer folder (default: --model-path)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: %(default)s, this host only; give --api-key too when "
                        "listening on an address other hosts reach)")
    p.add_argument("--port", type=int, default=30000, help="0 picks a free port")
    p.add_argument("--tp-size", "--tp", dest="tp_size", type=int, default=1, help="only 1 is supported")
    p.add_argument("--random-seed", type=int, default=0,
                   help="base seed of requests without a sampling_seed, mixed with their rid (or their arrival "
                        "order): a fixed seed reproduces a run (default: %(default)s)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="auto: float32 on CPU, the checkpoint's dtype on CUDA")
    p.add_argument("--mem-fraction-static", type=float, default=None, help="accepted for SGLang parity; ignored")
    p.add_argument("--device", default=None, choices=("cpu", "cuda"), help="default: cuda if available")
    p.add_argument("--max-running-requests", type=int, default=64, help="batch slots")
    p.add_argument("--kv-cache-tokens", type=int, default=None,
                   help="KV cache budget in tokens, split evenly over the slots (default: slots x min(context, 4096))")
    p.add_argument("--disable-cuda-graph", action="store_true",
                   help="decode eagerly on CUDA (default: replay captured CUDA graphs of the decode step)")
    p.add_argument("--cuda-graph-max-bs", type=int, default=None,
                   help="largest batch decoded through CUDA graphs (default: --max-running-requests)")
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="MoE models: keep the experts each layer routes every token to, returned by /generate's "
                        "return_routed_experts (SGLang's meta_info.routed_experts)")
    p.add_argument("--enable-torch-compile", action="store_true",
                   help="torch.compile the layers of the CUDA-graph decode step (fused kernels; compiles at start)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health, /health_generate and /ready "
                        "(default: $SLIME_LITE_ENGINE_API_KEY, else the first line of "
                        "$SLIME_LITE_ENGINE_API_KEY_FILE; those keep the key off the command line)")
    p.add_argument("--max-request-bytes", type=int, default=MAX_REQUEST_BYTES,
                   help="largest request body, in bytes, on every route but /update_weights_from_tensor "
                        f"(default {MAX_REQUEST_BYTES >> 20} MiB); larger ones get HTTP 413")
    p.add_argument("--disable-radix-cache", action="store_true",
                   help="no prefix cache: every prompt is prefilled in full (meta_info.cached_tokens stays 0)")
    p.add_argument("--enable-memory-saver", action="store_true",
                   help="reported in /get_server_info for SGLang parity (slime compares it); memory release works "
                        "either way")
    p.add_argument("--served-model-name", default=None, help="model name in /v1/models (default: --model-path)")
    p.add_argument("--profile-dir", default=None,
                   help="the only folder /start_profile writes traces under: its output_dir must lie inside "
                        "(relative ones are taken from here; default: $SGLANG_TORCH_PROFILER_DIR, else "
                        "slime-lite-profiles in the temp folder)")
    p.add_argument("--log-level", default="info", type=str.upper, choices=LOG_LEVELS,
                   help="Python logging level (default: %(default)s; debug also shows third-party libraries' noise)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args, unknown = parser.parse_known_args(argv)
    except SystemExit as exc:  # --help, or a bad value (argparse printed why)
        return int(exc.code or 0)
    if unknown:
        flags = [u for u in unknown if u.startswith("-")] or unknown
        raise SlimeLiteError(f"slime-lite serve: unknown flag(s) {' '.join(flags)}; the embedded engine accepts "
                             "the flags listed by 'slime-lite serve --help'.")
    if args.tp_size != 1:
        raise SlimeLiteError(f"--tp-size {args.tp_size}: the embedded engine runs on one device (tp_size 1); "
                             "use --rollout-backend sglang for tensor-parallel engines.")
    setup_logging(args.log_level)
    if args.mem_fraction_static is not None:
        logger.info("--mem-fraction-static %s ignored: the KV cache is sized by --kv-cache-tokens",
                    args.mem_fraction_static)
    server = EngineServer(
        args.model_path, tokenizer_path=args.tokenizer_path, host=args.host, port=args.port, dtype=args.dtype,
        device=args.device, seed=args.random_seed, max_running_requests=args.max_running_requests,
        kv_cache_tokens=args.kv_cache_tokens, api_key=args.api_key or api_key(),
        served_model_name=args.served_model_name,
        cuda_graph=False if args.disable_cuda_graph else None, cuda_graph_max_bs=args.cuda_graph_max_bs,
        enable_torch_compile=args.enable_torch_compile, max_request_bytes=args.max_request_bytes,
        disable_radix_cache=args.disable_radix_cache, enable_memory_saver=args.enable_memory_saver,
        profile_dir=args.profile_dir,
        enable_return_routed_experts=args.enable_return_routed_experts,
    )
    server.run_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
