"""A Llama model directory with random weights that any server can load: config.json, a
word-level tokenizer covering the whole vocabulary (token i is the word "t<i>", so text and
token ids map one to one), and bf16 safetensors shards.

pdserve loads real files only; vLLM can skip them (`--load-format dummy`) and still needs the
config and the tokenizer. Weights are drawn on the GPU when there is one (a 16 GB 8B shape is
then bounded by the disk, not by the random number generator) and written shard by shard.

    python bench/random_model.py --shape 1b --out DIR [--device cuda]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine import SHAPES

_READY = ".random-model.json"  # written last: a directory without it is incomplete
_SHARD_BYTES = 2 << 30


def tensor_shapes(cfg: dict[str, Any]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every tensor of a Hugging Face LlamaForCausalLM checkpoint, in its names and shapes."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // hq
    yield "model.embed_tokens.weight", (v, h)
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        yield p + "input_layernorm.weight", (h,)
        yield p + "self_attn.q_proj.weight", (hq * d, h)
        yield p + "self_attn.k_proj.weight", (hkv * d, h)
        yield p + "self_attn.v_proj.weight", (hkv * d, h)
        yield p + "self_attn.o_proj.weight", (h, hq * d)
        yield p + "post_attention_layernorm.weight", (h,)
        yield p + "mlp.gate_proj.weight", (i, h)
        yield p + "mlp.up_proj.weight", (i, h)
        yield p + "mlp.down_proj.weight", (h, i)
    yield "model.norm.weight", (h,)
    if not cfg.get("tie_word_embeddings", False):
        yield "lm_head.weight", (v, h)


def write_tokenizer(out: Path, vocab_size: int, bos: int | None, eos: int | None) -> None:
    """A word-level tokenizer: id i <-> "t<i>", words split on whitespace, decoded joined by spaces.
    bos/eos (if any) are special tokens named as Llama 3 names them."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = {i: f"t{i}" for i in range(vocab_size)}
    specials = {}
    if bos is not None:
        names[bos] = specials["bos_token"] = "<|begin_of_text|>"
    if eos is not None:
        names[eos] = specials["eos_token"] = "<|end_of_text|>"
    unk = names[0]
    tok = Tokenizer(models.WordLevel({w: i for i, w in names.items()}, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=unk, clean_up_tokenization_spaces=False, **specials)
    fast.save_pretrained(str(out))


_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def save_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """The safetensors format written straight from the tensors' memory: `safetensors.save_file`
    first builds the whole file in one bytes object, a second copy of every byte."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for t in tensors.values():
            f.write(t.contiguous().view(torch.uint8).numpy().data)


def _fingerprint(cfg: dict[str, Any], seed: int) -> str:
    return hashlib.sha256(json.dumps({"config": cfg, "seed": seed}, sort_keys=True).encode()).hexdigest()[:16]


def write_model(
    out: Path, cfg: dict[str, Any], seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.bfloat16
) -> dict[str, Any]:
    """Write the directory (reused as is when it already holds this config and seed); returns
    {"dir", "bytes", "seconds", "reused"}. Weights ~ N(0, 0.02), norms 1: the scale of
    `load_format="dummy"`."""
    out.mkdir(parents=True, exist_ok=True)
    fp = _fingerprint(cfg, seed)
    ready = out / _READY
    if ready.is_file() and json.loads(ready.read_text()).get("fingerprint") == fp:
        return {"dir": str(out), "bytes": json.loads(ready.read_text())["bytes"], "seconds": 0.0, "reused": True}
    ready.unlink(missing_ok=True)
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    t0 = time.perf_counter()
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    write_tokenizer(out, cfg["vocab_size"], cfg.get("bos_token_id"), cfg.get("eos_token_id"))
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = list(tensor_shapes(cfg))
    elem = torch.empty((), dtype=dtype).element_size()
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in shapes:
        nbytes = elem * int(torch.Size(shape).numel())
        if shards[-1] and size + nbytes > _SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    weight_map, total = {}, 0
    for k, shard in enumerate(shards):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, shape in shard:
            t = torch.empty(shape, dtype=dtype, device=device)
            if name.endswith("norm.weight"):
                t.fill_(1.0)
            else:
                t.normal_(0.0, 0.02, generator=gen)
            tensors[name] = t.cpu()
            weight_map[name] = fname
            total += t.numel() * elem
        save_safetensors(out / fname, tensors)
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    seconds = time.perf_counter() - t0
    ready.write_text(json.dumps({"fingerprint": fp, "bytes": total, "seconds": round(seconds, 2)}) + "\n")
    return {"dir": str(out), "bytes": total, "seconds": round(seconds, 2), "reused": False}


def shape_config(shape: str, max_position_embeddings: int | None = None) -> dict[str, Any]:
    """The config of a named shape (bench/engine.py's 1b, 8b)."""
    if shape not in SHAPES:
        raise ValueError(f"shape: unknown {shape!r}; one of {', '.join(SHAPES)}")
    cfg = dict(SHAPES[shape])
    if max_position_embeddings is not None:
        cfg["max_position_embeddings"] = max_position_embeddings
    return cfg


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--config-only", action="store_true",
        help="write the config and tokenizer, no weights: for engines loaded with load_format dummy",
    )
    args = p.parse_args(argv)
    cfg = shape_config(args.shape)
    if args.config_only:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        write_tokenizer(args.out, cfg["vocab_size"], cfg.get("bos_token_id"), cfg.get("eos_token_id"))
        print(json.dumps({"dir": str(args.out), "weights": "none (load_format dummy)"}))
        return 0
    print(json.dumps(write_model(args.out, cfg, args.seed, args.device)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
