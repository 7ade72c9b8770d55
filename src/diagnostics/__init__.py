"""Pre-launch diagnostics behind `python check_gpu.py`.

The check reads the machine once, then judges it with pure functions:

- `inputs`        what the user asked: the launcher's flags and recipe (parsed by src/config.py), the settings
                  that decide memory, parameter counts.
- `software`      Python, torch/NCCL/gloo, library versions, NCCL_*/CUDA_* variables and nccl.conf.
- `system`        CPU, memory, /dev/shm, memlock, container/VM, IOMMU, InfiniBand, the rendezvous port.
- `nvml_probe`    driver and per-GPU facts through NVML (nvidia-ml-py), tolerant of per-call errors.
- `devices`       which GPUs CUDA will show the training processes, in CUDA's numbering.
- `topology`      the `nvidia-smi topo -m` matrix, the P2P matrix and the transport NCCL will pick per pair.
- `model_shape`   a model's parameter and layer sizes, from a config (meta device) or a parameter count.
- `memory_plan`   memory per GPU for full fine-tuning (DDP, ZeRO-1/2/3, FSDP2), LoRA, QLoRA and the largest batch that fits.
- `bandwidth`     the all-reduce bus-bandwidth measurement, run in a child process with a hard timeout
                  (`allreduce_worker` is that child).
- `problems`      one rule per problem it can detect, each with its fix.
- `verdict`       ready / ready with warnings / not ready, the exit status and the launch command.
- `report`        runs the steps above in order and returns one JSON-able report.
- `render`        the human-readable text of a report.
"""
