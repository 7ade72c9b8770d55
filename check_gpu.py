"""Know before launch whether this machine is ready to train, and exactly how to launch.

    python check_gpu.py                                   # software, driver, GPUs, topology, problems, verdict
    python check_gpu.py --bench                           # + all-reduce bus bandwidth (NCCL on GPUs, gloo on CPU)
    python check_gpu.py --config configs/default.yaml --model Qwen/Qwen2.5-7B   # + memory per GPU for the recipe
    python check_gpu.py --params 7e9 --lora --json        # one JSON object for programs

Exit status: 0 ready, 1 ready with warnings, 2 not ready, 3 bad input (nothing was checked).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys

from src.diagnostics.inputs import CheckOptions, InputError, STAGES, parse_param_count, training_setup
from src.diagnostics.render import render
from src.diagnostics.report import Sources, check
from src.diagnostics.verdict import EXIT_BAD_INPUT


class _Parser(argparse.ArgumentParser):
    """argparse exits 2 on a usage error, which here means "not ready"; bad input exits 3."""

    def error(self, message: str) -> None:
        self.print_usage(sys.stderr)
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="check_gpu.py",
        description="Pre-launch check: software, driver and GPUs, topology and NCCL transport, memory plan, "
        "bandwidth, problems with fixes, and the launch command.",
        epilog="Exit status: 0 ready, 1 ready with warnings, 2 not ready, 3 bad input.",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--bench", action="store_true", help="measure all-reduce bus bandwidth in a child process")
    parser.add_argument("--bench_timeout", type=float, default=90.0, help="seconds before a hung measurement is killed")
    parser.add_argument("--num_procs", type=int, help="processes you intend to launch (default: one per usable GPU, 2 on CPU)")
    plan = parser.add_argument_group("memory plan (recipe keys; flags override --config)")
    plan.add_argument("--config", help="recipe YAML, e.g. configs/default.yaml")
    plan.add_argument("--model", help="local model directory with config.json, or a Hub id (cached or reachable)")
    plan.add_argument("--params", help="parameter count instead of a model, e.g. 7e9 or 1.5B")
    plan.add_argument("--stage", choices=STAGES, help="dpo (chosen + rejected, reference model) or sft")
    plan.add_argument("--max_length", type=int, help="tokens per sequence (prompt + completion)")
    plan.add_argument("--per_device_batch_size", type=int, help="sequences (DPO: pairs) per GPU per step")
    plan.add_argument("--lora", action="store_true", help="LoRA adapters on a frozen 16-bit base")
    plan.add_argument("--qlora", action="store_true", help="LoRA adapters on a 4-bit (NF4) base")
    plan.add_argument("--precompute_ref_log_probs", choices=["true", "false"],
                      help="DPO: reference log-probs computed before training, so no reference model in memory "
                      "(the toolkit's default: true; false keeps a reference copy per GPU)")
    plan.add_argument("--gradient_checkpointing", action="store_true",
                      help="recompute activations in the backward pass (the toolkit's default is off)")
    return parser


def options_from(args: argparse.Namespace) -> CheckOptions:
    if args.num_procs is not None and args.num_procs < 1:
        raise InputError(f"--num_procs {args.num_procs}: give at least 1")
    if args.model and args.params:
        raise InputError("--model and --params both given: name the model, or give its size, not both")
    flags = {
        "model_name_or_path": args.model,
        "stage": args.stage,
        "max_length": args.max_length,
        "per_device_batch_size": args.per_device_batch_size,
        "use_lora": True if args.lora or args.qlora else None,
        "load_in_4bit": True if args.qlora else None,
        "gradient_checkpointing": True if args.gradient_checkpointing else None,
        "precompute_ref_log_probs": None if args.precompute_ref_log_probs is None else
        args.precompute_ref_log_probs == "true",
    }
    flags = {name: value for name, value in flags.items() if value is not None}
    overrides = dict(flags)
    if args.params is not None:
        overrides["param_count"] = parse_param_count(args.params)
    if args.lora or args.qlora:
        overrides["method_chosen"] = True
    return CheckOptions(
        as_json=args.json,
        bench=args.bench,
        bench_timeout_s=args.bench_timeout,
        num_procs=args.num_procs,
        training=training_setup(args.config, overrides),
        training_flags=flags,
    )


def main(argv: list[str] | None = None, sources: Sources | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        options = options_from(args)
        report = check(options, sources or Sources.this_machine())
    except InputError as error:
        print(f"check_gpu.py: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(json.dumps(report, indent=2) if options.as_json else render(report), end="" if not options.as_json else "\n")
    return report["exit_code"]


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `check_gpu.py --json | head` ends quietly, as other CLI tools do
    sys.exit(main())
