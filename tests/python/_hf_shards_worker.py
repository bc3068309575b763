"""torchrun worker for test_transformers.py's uneven-shard cases: a tiny
float64 regression model (no loss kwargs: reduction "mean") under
gradaccum.transformers.Trainer (or, with --stock, transformers.Trainer), one
case per --case, each rank's results written to <out>/<case>-<rank>.pt.

- ``eval``: 16 training rows (4 batches of 2 per rank, K=2), evaluated after
  every step on 5 rows, which do not split evenly over 2 ranks x 2 rows.
- ``save_at_flush``: 14 rows, 7 batches: rank 0 has 4 (two full windows),
  rank 1 has 3, so rank 0's last full window is reduced with rank 1's
  flush(); a checkpoint is saved at that step.
- ``flos``: 26 rows, 13 batches: rank 0 has 7, rank 1 has 6, so the epoch's
  last window holds a batch on rank 0 only; logging at every step.
- ``split_batches``: 15 rows, each batch of 2 split over the ranks (a row
  each): rank 0 has 8 micro-batches, rank 1 has 7 (its slice of the last
  batch is empty), though both loaders' len() is 8.
- ``bf16_wire``: the ``flos`` shards on a bf16 wire (``comm_dtype``), which
  carries no loss, logging every 2 steps, learning rate 0 (every window's
  loss is then the reference's).
- ``empty_shard``: 2 rows, one batch: rank 0 has it, rank 1 has none, for 3
  epochs (fewer batches than ranks).
- ``tokens``: the ``flos`` shards with ``include_num_input_tokens_seen`` (the
  model's main input ``x``: 4 "tokens" a row), logging at every step.
- ``no_use_cpu``: TrainingArguments without ``use_cpu=True`` on this CPU-only
  torch: transformers sees one process, so ``train()`` is refused (each
  rank's error text is written).
"""
import argparse
import os

import torch
import torch.nn as nn
import transformers
from transformers import TrainingArguments

B, K, LR = 2, 2, 0.1
ROWS = {"eval": 16, "save_at_flush": 14, "flos": 26, "split_batches": 15, "bf16_wire": 26, "empty_shard": 2,
        "tokens": 26, "no_use_cpu": 16}
EPOCHS = {"empty_shard": 3}


class Regression(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()

    def forward(self, x, labels=None):
        out = self.net(x)
        return {"loss": None if labels is None else nn.functional.mse_loss(out, labels), "logits": out}


class Rows(torch.utils.data.Dataset):
    def __init__(self, n, seed=1):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 4, generator=g, dtype=torch.float64)
        self.y = torch.randn(n, 1, generator=g, dtype=torch.float64)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


def collate(rows):
    return {"x": torch.stack([r["x"] for r in rows]), "labels": torch.stack([r["labels"] for r in rows])}


def run(case, out, stock):
    from gradaccum.transformers import Trainer as Ours
    trainer_class = transformers.Trainer if stock else Ours
    folder = os.path.join(out, f"{case}{'-stock' if stock else ''}")
    extra = {
        "eval": dict(eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=B, save_strategy="no"),
        "save_at_flush": dict(save_strategy="steps", save_steps=2),
        "flos": dict(logging_steps=1, save_strategy="no"),
        "split_batches": dict(accelerator_config={"split_batches": True}, save_strategy="no"),
        "bf16_wire": dict(logging_steps=2, save_strategy="no"),
        "empty_shard": dict(save_strategy="no"),
        "tokens": dict(include_num_input_tokens_seen=True, logging_steps=1, save_strategy="no"),
        "no_use_cpu": dict(save_strategy="no"),
    }[case]
    options = {"accumulator_options": {"comm_dtype": torch.bfloat16}} if case == "bf16_wire" and not stock else {}
    args = TrainingArguments(folder, per_device_train_batch_size=B, gradient_accumulation_steps=K,
                             num_train_epochs=EPOCHS.get(case, 1),
                             learning_rate=0.0 if case == "bf16_wire" else LR, lr_scheduler_type="constant", optim="sgd", report_to=[],
                             use_cpu=case != "no_use_cpu",
                             seed=0, train_sampling_strategy="sequential", **extra)
    model = Regression()
    if case == "tokens":
        model.main_input_name = "x"
    trainer = trainer_class(model=model, args=args, train_dataset=Rows(ROWS[case]), data_collator=collate,
                            eval_dataset=Rows(5, seed=2) if case == "eval" else None, **options)
    if case == "no_use_cpu":
        try:
            trainer.train()
            refused = None
        except ValueError as error:
            refused = str(error)
        torch.save({"refused": refused, "params": [p.detach().clone() for p in model.parameters()]},
                   os.path.join(out, f"{case}-{os.environ['RANK']}.pt"))
        return
    output = trainer.train()
    result = {"params": [p.detach().clone() for p in model.parameters()], "global_step": trainer.state.global_step,
              "evals": [log["eval_loss"] for log in trainer.state.log_history if "eval_loss" in log],
              "checkpoints": sorted(f for f in os.listdir(folder) if f.startswith("checkpoint-")),
              "losses": [log["loss"] for log in trainer.state.log_history if "loss" in log],
              "train_loss": output.training_loss, "tokens_seen": trainer.state.num_input_tokens_seen,
              "logged_tokens": [log["num_input_tokens_seen"] for log in trainer.state.log_history
                                if "loss" in log and "num_input_tokens_seen" in log]}
    if case == "eval":
        result["final_eval"] = trainer.evaluate()["eval_loss"]
    torch.save(result, os.path.join(out, f"{case}{'-stock' if stock else ''}-{os.environ['RANK']}.pt"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--case", required=True, help="comma-separated: " + ", ".join(ROWS))
    parser.add_argument("--stock", action="store_true")
    opts = parser.parse_args()
    for case in opts.case.split(","):
        run(case, opts.out, opts.stock)


if __name__ == "__main__":
    main()
