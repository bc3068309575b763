"""A tiny causal LM trained by gradaccum.transformers.Trainer, launched by torchrun.

    torchrun --standalone --nproc_per_node=2 examples/python/train_hf_trainer.py --case uneven

(or `python -m torch.distributed.run --standalone --nproc_per_node=2 ...`, or
plain `python` for one process). Nothing is downloaded: a 2-layer GPT-2 built
from a config, randomly initialised, in float64, on synthetic token sequences.
`gradient_accumulation_steps` (K) micro-batches of B sequences per rank make
one optimizer step; gradaccum all-reduces the gradients once per window, and
the window's gradient is that of the per-token mean loss over every real
next-token target of the window on all ranks.

Cases (`--case`, several separated by commas run one after the other):

- `even`: every sequence full length, the data an exact number of windows;
- `partial`: 29 sequences, so the epoch's last window is partial (and its last
  micro-batch holds one sequence); clipping at `max_grad_norm=0.3`;
- `uneven`: right-padded sequences of random lengths (labels -100 on the
  padding), so micro-batches and ranks hold different numbers of tokens;
  checkpoints every 2 steps.

`--stock` trains with `transformers.Trainer` instead (DDP, its own
accumulation), `--resume-from N` resumes a case from its `checkpoint-N`.
Rank 0 prints each optimizer step's logged loss and the Accumulator's
stats(), and with `--out` saves them with the final parameters to
`OUT/<case>[-stock][-resumed-N].pt` (tests/python/test_transformers.py reads
them and compares with a one-process reference computed with torch alone).
"""
import argparse
import os
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.nn as nn

import transformers
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments, default_data_collator

from gradaccum.transformers import Trainer  # was: from transformers import Trainer

VOCAB, SEQ = 50, 12

#: name: (sequences, epochs, padded, max_grad_norm, save_steps)
CASES = {
    "even": (24, 2, False, 0.0, None),
    "partial": (29, 2, False, 0.3, None),
    "uneven": (36, 2, True, 0.0, 2),
}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", default="uneven", help="comma-separated: " + ", ".join(CASES))
    p.add_argument("--accum", type=int, default=3, help="gradient_accumulation_steps (K)")
    p.add_argument("--batch", type=int, default=2, help="per_device_train_batch_size (B)")
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stock", action="store_true", help="transformers.Trainer instead of gradaccum's")
    p.add_argument("--resume-from", type=int, default=None, help="resume from the case's checkpoint-N")
    p.add_argument("--out", default=None, help="folder for checkpoints and results (default: a temporary one)")
    return p.parse_args(argv)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                   num_items_in_batch: Optional[torch.Tensor] = None, ignore_index: int = -100,
                   **kwargs: object) -> torch.Tensor:
    """transformers' ForCausalLMLoss without its `logits.float()`, which would
    round a float64 model's logits to float32: next-token cross-entropy, summed
    and divided by `num_items_in_batch` when given, else the mean. Only the
    `--stock` run needs it (gradaccum's Trainer keeps a float64 model's loss in
    float64 itself), so that the comparison is not about rounding."""
    shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = nn.functional.cross_entropy(logits.reshape(-1, vocab_size), shift_labels.reshape(-1).to(logits.device),
                                       ignore_index=ignore_index, reduction=reduction)
    return loss / num_items_in_batch if num_items_in_batch is not None else loss


def make_model(seed: int) -> GPT2LMHeadModel:
    config = GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=16, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config).double()


def make_data(case: str, seed: int) -> List[Dict[str, torch.Tensor]]:
    """The case's sequences: input_ids, attention_mask and labels (-100 on padding)."""
    n, _, padded, _, _ = CASES[case]
    g = torch.Generator().manual_seed(seed + 1)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        length = int(torch.randint(1, SEQ + 1, (), generator=g)) if padded else SEQ
        mask = (torch.arange(SEQ) < length).long()
        labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
        rows.append({"input_ids": ids * mask, "attention_mask": mask, "labels": labels})
    return rows


def training_args(case: str, opts: argparse.Namespace, output_dir: str) -> TrainingArguments:
    _, epochs, _, clip, save_steps = CASES[case]
    return TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=opts.batch, gradient_accumulation_steps=opts.accum,
        num_train_epochs=epochs, learning_rate=opts.lr, optim="sgd", optim_args="momentum=0.9",
        lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.0, max_grad_norm=clip,
        logging_steps=1, save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        train_sampling_strategy="sequential", use_cpu=True, report_to=[], disable_tqdm=True, seed=opts.seed,
        dataloader_num_workers=0)


def run_case(case: str, opts: argparse.Namespace, out: str) -> Dict[str, Any]:
    trainer_cls: Any = transformers.Trainer if opts.stock else Trainer
    tag = case + ("-stock" if opts.stock else "")
    resume = None
    output_dir = os.path.join(out, tag)
    if opts.resume_from is not None:
        resume = os.path.join(output_dir, f"checkpoint-{opts.resume_from}")
        tag += f"-resumed-{opts.resume_from}"
        output_dir = os.path.join(out, tag)
    model = make_model(opts.seed)
    if opts.stock:
        model.loss_function = causal_lm_loss
    trainer = trainer_cls(model=model, args=training_args(case, opts, output_dir), train_dataset=make_data(case, opts.seed),
                          data_collator=default_data_collator)
    trainer.train(resume_from_checkpoint=resume)
    losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    result = {
        "losses": [losses[s] for s in sorted(losses)],
        "steps": sorted(losses),
        "global_step": trainer.state.global_step,
        "params": {k: v.detach().clone() for k, v in model.named_parameters()},
        "stats": getattr(trainer, "accumulator_stats", None),
        "world_size": trainer.args.world_size,
    }
    if trainer.args.process_index == 0:
        for step, loss in zip(result["steps"], result["losses"]):
            print(f"{tag} step {step} loss {loss!r}")
        if result["stats"] is not None:
            s = result["stats"]
            print(f"{tag} stats: windows {s['windows']} optimizer_steps {s['optimizer_steps']} "
                  f"collectives {s['collectives']} buckets {s['buckets']} world_size {s['world_size']}")
        torch.save(result, os.path.join(out, tag + ".pt"))
    return result


def main(argv: Optional[Sequence[str]] = None) -> None:
    opts = parse_args(argv)
    out = opts.out
    if out is None:
        import tempfile
        out = tempfile.mkdtemp(prefix="gradaccum-hf-")  # rank 0's; fine for one process or a demo
    for case in opts.case.split(","):
        if case not in CASES:
            raise SystemExit(f"unknown case {case!r} (expected one of {', '.join(CASES)})")
        run_case(case, opts, out)


if __name__ == "__main__":
    main()
