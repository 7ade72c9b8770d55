"""Know before launch whether this machine is ready to train, and exactly how to launch.

    python check_gpu.py                                   # software, driver, GPUs, topology, problems, verdict
    python check_gpu.py --bench                           # + all-reduce bus bandwidth (NCCL on GPUs, gloo on CPU)
    python check_gpu.py --num_procs 8 --config configs/dpo_qwen2.5-0.5b_ultrafeedback.yaml --batch_size 64 --use_lora
                                                          # + the launcher's plan and memory per GPU for that launch
    python check_gpu.py --params 7e9 --use_lora --json    # a size instead of a model; one JSON object for programs

Every flag of the launcher is taken with its meaning (src/config.py parses them, recipe and all), so
`./run_distributed.sh N ARGS` checks as `python check_gpu.py --num_procs N ARGS`, and the command the check prints
runs as it was checked.

Exit status: 0 ready, 1 ready with warnings, 2 not ready, 3 bad input (nothing was checked).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys

from src import library_warnings
from src.diagnostics.inputs import CheckOptions, InputError, parse_launch_arguments, parse_param_count, training_setup
from src.diagnostics.render import render
from src.diagnostics.check import Sources, check
from src.diagnostics.verdict import EXIT_BAD_INPUT

# check_gpu's own flags; every other flag is the launcher's.
OWN_FLAGS = ("json", "bench", "bench_timeout", "num_procs", "params", "help")
# The names check_gpu.py used before it took the launcher's, kept for one release (with one notice line each).
OLD_NAMES = {"model": ("--model_name_or_path",), "lora": ("--use_lora",), "qlora": ("--use_lora", "--load_in_4bit")}


class _Parser(argparse.ArgumentParser):
    """check_gpu's own flags through argparse, every other flag to the launcher's parser (src/config.py)."""

    def error(self, message: str) -> None:
        # argparse exits 2 on a usage error, which here means "not ready"; bad input exits 3.
        self.print_usage(sys.stderr)
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}\n")

    def parse_args(self, args=None, namespace=None):
        own, launch, old_names = split_arguments(list(sys.argv[1:] if args is None else args))
        namespace = super().parse_args(own, namespace)
        namespace.launch_arguments, namespace.old_names = launch, old_names
        return namespace


def split_arguments(argv: list[str]) -> tuple[list[str], list[str], list[str]]:
    """(check_gpu's own tokens, the launcher's tokens with old names translated, the old names used). A flag owns the
    tokens after it up to the next `--flag`, as the launcher reads them."""
    groups: list[list[str]] = []
    for token in argv:
        if token.startswith("--") or token == "-h" or not groups:
            groups.append([token])
        else:
            groups[-1].append(token)
    own, launch, old_names = [], [], []
    for group in groups:
        name, equals, value = group[0].lstrip("-").partition("=")
        if name in OWN_FLAGS or not group[0].startswith("--"):
            own += group
        elif name in OLD_NAMES:
            new = list(OLD_NAMES[name])
            new[0] += equals + value  # --model=x -> --model_name_or_path=x
            launch += new + group[1:]
            if name not in old_names:
                old_names.append(name)
        else:
            launch += group
    return own, launch, old_names


def old_name_notice(name: str) -> str:
    return (f"note: --{name} is now {' '.join(OLD_NAMES[name])} (the launcher's name); the old name works until the "
            "next release")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="check_gpu.py",
        usage="python check_gpu.py [--num_procs N] [--json] [--bench] [--params COUNT] [LAUNCHER FLAGS ...]",
        description="Pre-launch check: software, driver and GPUs, topology and NCCL transport, the launcher's plan, "
        "memory plan, bandwidth, problems with fixes, and the launch command. Takes every flag of "
        "./run_distributed.sh (--config RECIPE.yaml, --model_name_or_path, --batch_size, --use_lora, ...; "
        "`python -m src.main_distributed --help` lists them) with the same meaning.",
        epilog="Exit status: 0 ready, 1 ready with warnings, 2 not ready, 3 bad input.",
        allow_abbrev=False,  # a prefix of a launcher flag must not be taken for one of these
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--bench", action="store_true", help="measure all-reduce bus bandwidth in a child process")
    parser.add_argument("--bench_timeout", type=float, default=90.0, help="seconds before a hung measurement is killed")
    parser.add_argument("--num_procs", type=int,
                        help="processes per node you intend to launch, run_distributed.sh's N (default: one per usable "
                        "GPU, 2 on CPU); the launcher's global --batch_size is split over them")
    parser.add_argument("--params", help="parameter count instead of a model, e.g. 7e9 or 1.5B")
    return parser


def options_from(args: argparse.Namespace) -> CheckOptions:
    if args.num_procs is not None and args.num_procs < 1:
        raise InputError(f"--num_procs {args.num_procs}: give at least 1")
    param_count = parse_param_count(args.params) if args.params is not None else None
    config = parse_launch_arguments(args.launch_arguments, size_given=param_count is not None)
    if param_count is not None and config.sources.get("model_name_or_path", "").startswith("--"):
        model_flag = "--model" if "model" in args.old_names else "--model_name_or_path"
        raise InputError(f"{model_flag} and --params both given: name the model, or give its size, not both")
    return CheckOptions(
        as_json=args.json,
        bench=args.bench,
        bench_timeout_s=args.bench_timeout,
        num_procs=args.num_procs,
        config=config,
        launch_arguments=args.launch_arguments,
        param_count=param_count,
        training=training_setup(config, param_count),
    )


def main(argv: list[str] | None = None, sources: Sources | None = None) -> int:
    library_warnings.install()  # the libraries' known-harmless lines kept off the report (DeepSpeed's, on CPU)
    args = build_parser().parse_args(argv)
    for name in args.old_names:
        print(old_name_notice(name), file=sys.stderr)
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
