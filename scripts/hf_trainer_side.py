"""The Hugging Face side of scripts/bench_text.py's side-by-side with transformers' `Trainer`:
what transformers' examples/pytorch/text-classification/run_classification.py does with a CSV,
in one process -- AutoTokenizer and AutoModelForSequenceClassification from a folder that
`save_pretrained` wrote (the head sized from the training file's classes, sorted by name as kiln
sorts them), every text tokenized up front and truncated at --max-length, DataCollatorWithPadding
(each batch padded to its longest text), `Trainer` with its AdamW (no weight decay on biases and
LayerNorm weights), a linear schedule with warm-up, --steps optimizer steps, then the accuracy of
the final weights on the validation file. Both files have the columns `text` and `label`.
Prints one JSON line:

    python scripts/hf_trainer_side.py FOLDER train.csv val.csv --batch-size 32 --steps 200

Training samples/s is measured as kiln measures its own (summary.json's `samples_per_s`): the
samples of the training steps over the seconds of those steps, each step timed from the end of
the one before it (or the start of its epoch) to the end of its update -- fetching and padding
the batch, forward, backward, the optimizer and the schedule; not the set-up before train(), the
logging between steps (off here) or the evaluation. The Trainer's own `train_samples_per_second`
(its whole train() call, set-up included) is printed beside it.
"""

from __future__ import annotations

import argparse
import csv
import json
import time


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="a model folder written by save_pretrained")
    parser.add_argument("train", help="the training CSV (text, label)")
    parser.add_argument("val", help="the validation CSV (text, label)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps (max_steps)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--warmup-ratio", type=float, default=0.1)
    parser.add_argument("--max-length", type=int, default=64, help="truncation, in tokens")
    parser.add_argument("--max-grad-norm", type=float, default=0.0, help="0: no clipping")
    parser.add_argument("--classifier-dropout", type=float, default=0.0)
    parser.add_argument(
        "--sampler",
        choices=("group_by_length", "random"),
        default="group_by_length",
        help="the Trainer's train_sampling_strategy",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads")
    parser.add_argument("--output-dir", default="hf-trainer-out", help="the Trainer's output_dir")
    return parser.parse_args(argv)


def read_rows(path: str) -> tuple[list[str], list[str]]:
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    return [r["text"] for r in rows], [r["label"] for r in rows]


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    import transformers
    from transformers import (
        AutoConfig,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        Trainer,
        TrainerCallback,
        TrainingArguments,
        set_seed,
    )

    class Encoded(torch.utils.data.Dataset):
        """Tokenized texts and their label ids: what `datasets.map` makes in the example."""

        def __init__(self, tokenizer, texts: list[str], labels: list[int]):
            encoded = tokenizer(texts, truncation=True, max_length=args.max_length)
            self.items = [
                {**{key: values[i] for key, values in encoded.items()}, "labels": labels[i]}
                for i in range(len(texts))
            ]

        def __len__(self) -> int:
            return len(self.items)

        def __getitem__(self, index: int) -> dict:
            return self.items[index]

    class StepClock(TrainerCallback):
        """The seconds of the training steps: each from the end of the step before it (or the
        start of its epoch, before the batch is fetched) to the end of its update."""

        def __init__(self):
            self.seconds, self.steps, self.mark = 0.0, 0, None

        def on_epoch_begin(self, args, state, control, **kwargs):
            self.mark = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            self.seconds += now - self.mark
            self.steps, self.mark = self.steps + 1, now

    class CountingTrainer(Trainer):
        """The Trainer, counting the samples its training steps see (a last short batch too)."""

        samples = 0

        def training_step(self, model, inputs, *rest, **kwargs):
            self.samples += int(inputs["input_ids"].shape[0])
            return super().training_step(model, inputs, *rest, **kwargs)

    start = time.perf_counter()
    train_texts, train_names = read_rows(args.train)
    val_texts, val_names = read_rows(args.val)
    classes = sorted(set(train_names))
    label2id = {name: i for i, name in enumerate(classes)}
    tokenizer = AutoTokenizer.from_pretrained(args.folder, trust_remote_code=False)
    train_set = Encoded(tokenizer, train_texts, [label2id[name] for name in train_names])
    val_set = Encoded(tokenizer, val_texts, [label2id.get(name, -100) for name in val_names])
    set_seed(args.seed)
    config = AutoConfig.from_pretrained(
        args.folder,
        trust_remote_code=False,  # never the folder's own code, never a prompt (as kiln)
        num_labels=len(classes),
        id2label=dict(enumerate(classes)),
        label2id=label2id,
    )
    if hasattr(config, "classifier_dropout"):  # as kiln's model.dropout sets it
        config.classifier_dropout = args.classifier_dropout
    model = AutoModelForSequenceClassification.from_pretrained(
        args.folder,
        config=config,
        ignore_mismatched_sizes=True,  # another head: re-initialised
        trust_remote_code=False,
    )
    clock = StepClock()
    trainer = CountingTrainer(
        model=model,
        args=TrainingArguments(
            output_dir=args.output_dir,
            per_device_train_batch_size=args.batch_size,
            per_device_eval_batch_size=args.batch_size,
            max_steps=args.steps,
            learning_rate=args.lr,
            weight_decay=args.weight_decay,
            lr_scheduler_type="linear",
            warmup_steps=args.warmup_ratio,  # below 1: a share of max_steps
            max_grad_norm=args.max_grad_norm,
            train_sampling_strategy=args.sampler,
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            eval_strategy="no",
            logging_strategy="no",
            dataloader_num_workers=0,
            disable_tqdm=True,
            seed=args.seed,
        ),
        train_dataset=train_set,
        data_collator=DataCollatorWithPadding(tokenizer),
        processing_class=tokenizer,
        callbacks=[clock],
    )
    setup_s = time.perf_counter() - start
    train_start = time.perf_counter()
    metrics = trainer.train().metrics
    train_call_s = time.perf_counter() - train_start
    # Scored against the label ids predict() returns beside the predictions, in their order, as
    # run_classification's compute_metrics does: with group_by_length the Trainer groups the
    # evaluation's rows by length too, so they do not come in the file's order.
    output = trainer.predict(val_set)
    truth = output.label_ids  # -100: a class training never saw, never predicted
    predicted = output.predictions.argmax(-1)
    val_acc = float((predicted == truth).mean())
    # macro-F1 over the classes in the labels or the predictions, as kiln's evaluation counts it
    f1s = []
    for k in sorted((set(truth.tolist()) | set(predicted.tolist())) - {-100}):
        hits = int(((predicted == k) & (truth == k)).sum())
        f1s.append(2 * hits / max(int((predicted == k).sum() + (truth == k).sum()), 1))
    print(
        json.dumps(
            {
                "val_acc": val_acc,
                "val_macro_f1": float(sum(f1s) / max(len(f1s), 1)),
                "val_rows": len(truth),
                "train_rows": len(train_set),
                "classes": len(classes),
                "steps": clock.steps,
                "samples": trainer.samples,
                "train_time_s": clock.seconds,
                "samples_per_s": trainer.samples / max(clock.seconds, 1e-9),
                "train_call_s": train_call_s,
                "trainer_train_runtime": metrics.get("train_runtime"),
                "trainer_train_samples_per_second": metrics.get("train_samples_per_second"),
                "train_loss": metrics.get("train_loss"),
                "setup_s": setup_s,
                "threads": torch.get_num_threads(),
                "transformers": transformers.__version__,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
