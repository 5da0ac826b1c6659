"""A 2-layer GPT-2 (built from a config, nothing downloaded) trained by
the Hugging Face Trainer with ckptstore.transformers.CheckpointCallback.

    python hf_run.py STORE OUTPUT_DIR OUT [--kill-at STEP] [--resume] [--async]

24 optimizer steps, a checkpoint every 4, save_total_limit=2; with
--kill-at, SIGKILLs itself after that step; with --resume, restores the
store's latest step into OUTPUT_DIR and resumes from it; with --async, the
callback stores in the background. Writes the final
parameters to OUT (torch.save) and prints "done".
"""

import argparse
import os
import signal

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import ckptstore.transformers as ckt


class KillAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, 64, (48, 16), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("store")
    ap.add_argument("output_dir")
    ap.add_argument("out")
    ap.add_argument("--kill-at", type=int, default=None)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--async", dest="asynchronous", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        args.output_dir, max_steps=24, save_steps=4, save_total_limit=2, per_device_train_batch_size=4,
        learning_rate=1e-3, logging_steps=4, report_to=[], use_cpu=True, seed=0, data_seed=0,
        dataloader_num_workers=0, disable_tqdm=True,
    )
    callbacks = [ckt.CheckpointCallback(args.store, asynchronous=args.asynchronous)]
    if args.kill_at is not None:
        callbacks.append(KillAt(args.kill_at))
    trainer = Trainer(model=model, args=training, train_dataset=Tokens(), callbacks=callbacks)
    resume = ckt.restore(args.store, dir=args.output_dir) if args.resume else None
    trainer.train(resume_from_checkpoint=resume)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, args.out)
    costs = [e for e in trainer.state.log_history if "checkpoint/durable_s" in e]
    print("costs", ",".join(str(e["step"]) for e in costs), flush=True)
    print("done", trainer.state.global_step, resume, flush=True)


if __name__ == "__main__":
    main()
