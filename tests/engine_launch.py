"""What `accelerate launch --config_file configs/accelerate/<STRATEGY>.yaml` puts in its workers' environment,
computed by accelerate's own launch code without starting it, so a forked job (tests/forked.py) runs as its workers
would. Reads accelerate's private `_validate_launch_command` (the launch's own defaults from the config file)."""

from __future__ import annotations

from conftest import PROJECT_ROOT


def accelerate_environment(strategy: str, nproc: int = 2) -> dict[str, str]:
    """The variables accelerate launch sets for a DeepSpeed (zero1/2/3) or FSDP config, over this process's."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    config = PROJECT_ROOT / "configs" / "accelerate" / f"{strategy}.yaml"
    args = launch_command_parser().parse_args(["--config_file", str(config), "--num_processes", str(nproc),
                                               "src/main_distributed.py"])
    args, defaults, _ = _validate_launch_command(args)
    if args.use_deepspeed:  # as accelerate's launch_command does before its deepspeed_launcher
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
        _, environment = prepare_deepspeed_cmd_env(args)
    else:
        environment = prepare_multi_gpu_env(args)
    return environment
