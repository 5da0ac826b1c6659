"""A small LightningModule trained through ckptstore.lightning.CheckpointIO.

    python lightning_run.py STORE DIRPATH OUT [--kill-at STEP] [--resume]
        [--async] [--costs CSV_DIR]

Trains 6 epochs of 10 batches (no shuffle) with ModelCheckpoint(every
epoch, top 2 by val_loss, save_last); with --kill-at, SIGKILLs itself after
that optimizer step; with --resume, fits from ckpt_path="last"; with
--async, the plugin commits in the background; with --costs, SaveCosts
logs each save's cost to a CSVLogger in CSV_DIR. Writes the
final parameters to OUT (torch.save) and prints "done".
"""

import argparse
import os
import signal

import lightning.pytorch as pl
import torch
import torch.utils.data as tud
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import ckptstore.lightning


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.save_hyperparameters({"hidden": 16, "lr": 0.01})
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
        )

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, _):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.01)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)}


class KillAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *_):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def data(seed: int) -> tud.DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(100, 8, generator=g)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(100, 1, generator=g)
    return tud.DataLoader(tud.TensorDataset(x, y), batch_size=10, shuffle=False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("store")
    ap.add_argument("dirpath")
    ap.add_argument("out")
    ap.add_argument("--kill-at", type=int, default=None)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--async", dest="asynchronous", action="store_true")
    ap.add_argument("--costs", default=None)
    args = ap.parse_args()
    pl.seed_everything(0, verbose=False)
    callbacks = [
        ModelCheckpoint(dirpath=args.dirpath, every_n_epochs=1, save_top_k=2, monitor="val_loss",
                        save_last=True)
    ]
    if args.kill_at is not None:
        callbacks.append(KillAt(args.kill_at))
    logger = False
    if args.costs is not None:
        from lightning.pytorch.loggers import CSVLogger

        callbacks.append(ckptstore.lightning.SaveCosts())
        logger = CSVLogger(args.costs, name="costs")
    plugin = ckptstore.lightning.CheckpointIO(args.store, asynchronous=args.asynchronous)
    trainer = pl.Trainer(
        max_epochs=6, plugins=[plugin], callbacks=callbacks,
        logger=logger, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
        deterministic=True,
    )
    model = Model()
    trainer.fit(model, data(1), data(2), ckpt_path="last" if args.resume else None)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, args.out)
    print("done", trainer.global_step, flush=True)


if __name__ == "__main__":
    main()
