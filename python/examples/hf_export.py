"""A DCP step out as a Hugging Face checkpoint: a tiny GPT-2 (built here)
saved with dcp.save through ckptstore.dcp, exported with export_hf, and
loaded with transformers' from_pretrained.

    python python/examples/hf_export.py [BUCKET_URL]
"""

import sys
import tempfile

import torch
import torch.distributed.checkpoint as dcp
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

import ckptstore.dcp

with tempfile.TemporaryDirectory() as tmp:
    url = sys.argv[1] if len(sys.argv) > 1 else f"file://{tmp}/bucket"
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2)).eval()
    dcp.save(model.state_dict(), storage_writer=ckptstore.dcp.StorageWriter(url, step=100))

    out = f"{tmp}/gpt2-hf"
    written = ckptstore.dcp.export_hf(url, 100, out, max_shard_size="60KB")
    model.config.save_pretrained(out)  # the config is the caller's to write
    print(f"{len(written.weight_map)} tensors, {written.total_size} bytes in {len(written.shards)} shards:")
    print(" ", written.shards[0], "...", written.shards[-1], "+ model.safetensors.index.json")

    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.arange(16).reshape(1, 16)
    with torch.no_grad():
        same = torch.equal(loaded(ids).logits, model(ids).logits)
    print("from_pretrained gives the same logits:", same)
