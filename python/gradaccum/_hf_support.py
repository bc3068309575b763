"""What gradaccum.transformers.Trainer refuses: the Trainer's other kinds of
parallelism (it reduces gradients itself, once per window), and a process
group the TrainingArguments do not see (every rank would train on the whole
dataset)."""
from typing import Any

import torch


def check_supported(trainer: Any) -> None:
    args = trainer.args
    refused = []
    if trainer.is_deepspeed_enabled:
        refused.append("DeepSpeed")
    if trainer.is_fsdp_enabled or getattr(trainer, "is_fsdp_xla_enabled", False) or args.fsdp:
        refused.append("FSDP")
    if args.n_gpu > 1:
        refused.append(f"nn.DataParallel over {args.n_gpu} GPUs in one process (launch one process per GPU)")
    for what, size in (("tensor", trainer.get_tp_size()), ("context", trainer.get_cp_size()),
                       ("sequence", trainer.get_sp_size())):
        if size > 1:
            refused.append(f"{what} parallelism")
    if getattr(trainer, "is_distributed_loading_by_transformers", False):
        refused.append("a model sharded at load time")
    from transformers.utils import is_sagemaker_mp_enabled, is_torch_xla_available
    if is_sagemaker_mp_enabled():
        refused.append("SageMaker model parallelism")
    if is_torch_xla_available():
        refused.append("XLA")
    if refused:
        raise ValueError("gradaccum: gradaccum.transformers.Trainer does not support " + ", ".join(refused)
                         + ": it reduces gradients itself, once per window; use transformers.Trainer there")
    group = trainer.accumulator_options.get("process_group")
    if group is not False and torch.distributed.is_available() and torch.distributed.is_initialized() \
            and args.world_size == 1:
        ranks = torch.distributed.get_world_size(group)
        if ranks > 1:  # (alike on every rank: every rank raises)
            why, fix = (("on a torch without CUDA, transformers runs data parallel only with use_cpu=True",
                         "pass TrainingArguments(use_cpu=True)")
                        if not args.use_cpu and not torch.cuda.is_available() else
                        ("transformers takes its ranks from the launcher's environment: RANK and WORLD_SIZE",
                         "launch with torchrun or accelerate launch"))
            raise ValueError(
                f"gradaccum: trainer.train(): the process group has {ranks} ranks, but the TrainingArguments see one "
                f"process (args.world_size=1: {why}), so every rank would train on the whole dataset; {fix}, or "
                "accumulator_options={'process_group': False} to train each rank alone on purpose")
