"""One rank of a 2-rank job that trains a tiny GPT-2 (built here, nothing
downloaded) a few steps and saves it with dcp.save through ckptstore.dcp.

    python gpt2_worker.py URL RANK WORLD PORT OUT

Every rank trains the same replica (same seed, same batches); DCP's plan
spreads the tensors over the ranks. Rank 0 writes the model's config and
its logits on a fixed input to OUT (config.json, logits.pt)."""

import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import ckptstore.dcp


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def main():
    url, rank, world, port, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    model = tiny_gpt2()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, 96, (2, 16), generator=g)
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    dcp.save(model.state_dict(), storage_writer=ckptstore.dcp.StorageWriter(url, step=3))
    if rank == 0:
        model.eval()
        model.config.save_pretrained(out)
        with torch.no_grad():
            logits = model(torch.arange(16).reshape(1, 16)).logits
        torch.save(logits, os.path.join(out, "logits.pt"))
    dist.barrier()
    dist.destroy_process_group()
    print("saved", flush=True)


if __name__ == "__main__":
    main()
