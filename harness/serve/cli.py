"""`zoo serve`'s options: the model (a registry architecture at a preset, or a --weights folder), the engine's
layout, and the server's address, key and limits; every value checked before the model is built."""
from pathlib import Path

import torch

import zoo
from harness.compare import DTYPES
from harness.engine.block_manager import ADMISSIONS
from harness.engine import Engine
from zoo import checkpoint, checks
from zoo.weights import check_weights_file, load_weights

LOCALHOST = "127.0.0.1"


def add_parser(sub) -> None:
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over the engine (/v1/completions, "
                                     "/v1/chat/completions, /v1/models, /health, /metrics)")
    s.add_argument("--arch", default="gqa", help="architecture (default: gqa)")
    s.add_argument("--preset", default="tiny", choices=list(zoo.PRESETS), help="model size (default: tiny)")
    s.add_argument("--weights", default=None, help="a zoo train / zoo.save folder (its own architecture and size), "
                                                    "or a .safetensors state dict for --arch/--preset")
    s.add_argument("--model-name", default=None, help="the name clients ask for (default: the architecture's)")
    s.add_argument("--dtype", default="float32", choices=list(DTYPES), help="weights dtype (default: float32)")
    s.add_argument("--kv-cache", default="paged", choices=["contiguous", "paged"], help="KV cache layout (default: "
                                                                                        "paged)")
    s.add_argument("--max-batch", type=int, default=16, help="requests decoded together (default: 16)")
    s.add_argument("--max-seq-len", type=int, default=None, help="prompt + output tokens (default: the model's)")
    s.add_argument("--prefix-caching", action="store_true", help="share cached prompt prefixes (paged only)")
    s.add_argument("--admission", default="reserve", choices=list(ADMISSIONS),
                   help="paged admission: reserve a request's worst case, or optimistic with preemption (vLLM's; "
                        "default: reserve)")
    s.add_argument("--host", default=LOCALHOST, help=f"address to bind (default: {LOCALHOST}, this machine only)")
    s.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    s.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY on /v1/ routes")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (default: 1 MiB)")
    s.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request is aborted "
                                                                         "(default: 600)")
    s.add_argument("--max-waiting", type=int, default=512, help="waiting requests before new ones get 429 "
                                                                "(default: 512)")
    s.set_defaults(func=cmd_serve)


def build_model(args):
    folder = args.weights is not None and Path(args.weights).is_dir()
    if folder:
        checkpoint.check_checkpoint_folder(args.weights)
        return zoo.load(args.weights).to(dtype=DTYPES[args.dtype])
    if args.weights:
        check_weights_file(args.weights)
    torch.manual_seed(0)
    model = zoo.build(args.arch, preset=args.preset).to(dtype=DTYPES[args.dtype])
    if args.weights:
        load_weights(model, args.weights, f"{args.arch} (preset {args.preset})")
    return model


def cmd_serve(args) -> None:
    try:
        import uvicorn

        from harness.serve.app import ServeSettings, create_app
    except ImportError as error:
        raise ValueError(f"zoo serve needs the serve extra (pip install -e '.[serve]'): {error}") from None
    checks.integer("port", args.port, minimum=0, maximum=65535)
    checks.integer("max_batch", args.max_batch, minimum=1)
    model = build_model(args)
    if not model.config.causal:
        raise ValueError(f"zoo serve runs causal models; {model.config.name!r} is a masked diffusion LM")
    settings = ServeSettings(args.model_name or model.config.name, args.api_key, args.max_body_bytes,
                             args.request_timeout, args.max_waiting)
    engine = Engine(model.eval(), max_batch=args.max_batch, max_seq_len=args.max_seq_len, kv_cache=args.kv_cache,
                    prefix_caching=args.prefix_caching, admission=args.admission)
    print(f"zoo serve: {settings.model_name} on http://{args.host}:{args.port}/v1 ({engine.kv_cache} cache, "
          f"max batch {args.max_batch}, max_seq_len {engine.max_seq_len})", flush=True)
    uvicorn.run(create_app(engine, settings), host=args.host, port=args.port, log_level="warning")
