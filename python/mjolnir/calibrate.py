"""Static KV scales for the vLLM plugin: record, convert, serve.

1. Record: run vLLM (with the plugin) over representative prompts with
   MJOLNIR_ATTN_KV_CALIBRATE=amax.json. Every layer mjolnir owns records the per-(KV head,
   channel) maximum of |K| and |V| it writes to its cache; the file is rewritten every few
   seconds and at exit.
2. Convert: python -m mjolnir.calibrate amax.json --format fp6_e2m3 --out kv_scales.json
   (or the CLI: mjolnir calibrate amax.json --format fp6_e2m3 --out kv_scales.json):
   scale = amax / format max * headroom, per channel by default.
3. Serve: MJOLNIR_ATTN_KV_FORMAT=fp6_e2m3 MJOLNIR_ATTN_KV_SCALES=kv_scales.json.

`python -m mjolnir.calibrate --model DIR --prompts FILE ...` does 1 and 2 in one go (vLLM
in-process over the prompts, one per line of token ids or of text).

Layers are matched by order: the names of the layers mjolnir owns, sorted by the numbers in
them (model.layers.0, model.layers.1, ...), in the amax file and in the serving model alike.
"""

from __future__ import annotations

import argparse
import atexit
import os
import re
import sys
import threading
import time
from typing import Dict, List, Optional, Tuple

import torch

from . import _ext

# How often a recording run rewrites its amax file (seconds).
FLUSH_SECONDS = 5.0


def layer_order(name: str):
    """Sort key: the numbers in a layer's name, then the name (model.layers.10 after .9)."""
    return [int(n) for n in re.findall(r"\d+", name)], name


class AmaxRecorder:
    """Running per-(KV head, channel) maxima of |K| and |V| per layer, written to `path`."""

    def __init__(self, path: str):
        self.path = path
        self.layers: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {}
        self.shape: Optional[Tuple[int, int]] = None
        self.lock = threading.Lock()
        self.last_flush = time.monotonic()
        atexit.register(self.flush)

    def record(self, name: str, key: torch.Tensor, value: torch.Tensor,
               slot_mapping: torch.Tensor) -> None:
        """key / value [tokens, Hk, D]; tokens whose slot is negative are not written, so not
        recorded."""
        keep = slot_mapping >= 0
        if not bool(keep.all()):
            key, value = key[keep], value[keep]
        if key.shape[0] == 0:
            return
        k = key.detach().abs().amax(dim=0).float().reshape(-1)
        v = value.detach().abs().amax(dim=0).float().reshape(-1)
        with self.lock:
            self.shape = (key.shape[1], key.shape[2])
            old = self.layers.get(name)
            self.layers[name] = (k, v) if old is None else (torch.maximum(old[0], k),
                                                            torch.maximum(old[1], v))
        if time.monotonic() - self.last_flush > FLUSH_SECONDS:
            self.flush()

    def flush(self) -> None:
        with self.lock:
            if not self.layers or self.shape is None:
                return
            names = sorted(self.layers, key=layer_order)
            rows = [(n, self.layers[n][0].tolist(), self.layers[n][1].tolist()) for n in names]
            tmp = self.path + ".tmp"
            _ext.write_amax_file(tmp, self.shape[0], self.shape[1], rows)
            os.replace(tmp, self.path)  # a reader never sees half a file
            self.last_flush = time.monotonic()


class Scales:
    """A scales file (read and checked by the C++ reader): per layer, K and V scale tensors."""

    def __init__(self, path: str):
        self.path = path
        data = _ext.read_scales_file(path)  # ValueError naming the file and field when bad
        self.format: str = data["format"]
        self.granularity: str = data["granularity"]
        self.num_kv_heads: int = data["num_kv_heads"]
        self.head_dim: int = data["head_dim"]
        self.layers: List[Tuple[torch.Tensor, torch.Tensor]] = [
            (torch.tensor(k, dtype=torch.float32), torch.tensor(v, dtype=torch.float32))
            for k, v in data["layers"]]

    def check(self, layer_names: List[str], num_kv_heads: int, head_dim: int,
              fmt: str) -> None:
        """The file must be for these layers, heads, head size and format; ValueError naming
        the file and the field otherwise (at engine start-up, not at the first request)."""
        where = f"MJOLNIR_ATTN_KV_SCALES={self.path}"
        if len(self.layers) != len(layer_names):
            raise ValueError(f"{where}: layers: {len(self.layers)} in the file, but the model "
                             f"has {len(layer_names)} layers on mjolnir")
        if self.num_kv_heads != num_kv_heads:
            raise ValueError(f"{where}: num_kv_heads: {self.num_kv_heads} in the file, but the "
                             f"model's layers have {num_kv_heads}")
        if self.head_dim != head_dim:
            raise ValueError(f"{where}: head_dim: {self.head_dim} in the file, but the model's "
                             f"layers have {head_dim}")
        if self.format != fmt:
            raise ValueError(f"{where}: format: {self.format} in the file, but the cache is "
                             f"{fmt} (MJOLNIR_ATTN_KV_FORMAT or vLLM's kv_cache_dtype)")


_recorders: Dict[str, AmaxRecorder] = {}
_scales: Dict[str, Scales] = {}


def recorder(path: str) -> AmaxRecorder:
    if path not in _recorders:
        _recorders[path] = AmaxRecorder(path)
    return _recorders[path]


def scales(path: str) -> Scales:
    if path not in _scales:
        _scales[path] = Scales(path)
    return _scales[path]


# --- python -m mjolnir.calibrate --------------------------------------------------------------


def _read_prompts(path: str) -> list:
    prompts = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            if re.fullmatch(r"[\d\s,]+", line):
                prompts.append({"prompt_token_ids": [int(t) for t in re.split(r"[\s,]+", line)
                                                     if t]})
            else:
                prompts.append(line)
    if not prompts:
        raise ValueError(f"--prompts: {path} holds no prompt")
    return prompts


def _record_with_vllm(model: str, prompts_path: str, amax_path: str, max_model_len: int) -> None:
    os.environ["MJOLNIR_ATTN_KV_CALIBRATE"] = amax_path
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # record in this process
    from vllm import LLM, SamplingParams
    prompts = _read_prompts(prompts_path)
    llm = LLM(model=model, max_model_len=max_model_len, enforce_eager=True,
              skip_tokenizer_init=all(isinstance(p, dict) for p in prompts))
    llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, detokenize=False),
                 use_tqdm=False)
    recorder(amax_path).flush()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mjolnir.calibrate",
        description="Recorded amax (MJOLNIR_ATTN_KV_CALIBRATE) -> a scales file for "
                    "MJOLNIR_ATTN_KV_SCALES; with --model, record it first.")
    parser.add_argument("amax", help="the amax file (read; with --model, written first)")
    parser.add_argument("--format", required=True, help="the KV cache format to serve with")
    parser.add_argument("--granularity", default="",
                        help="tensor, head or channel (default: the format's recommended one, "
                             "channel, head for nvfp4: docs/accuracy.md)")
    parser.add_argument("--headroom", type=float, default=1.0,
                        help="factor on amax (above 1: less saturation of unseen values)")
    parser.add_argument("--out", required=True, help="the scales file to write")
    parser.add_argument("--model", help="run vLLM with this model over --prompts to record")
    parser.add_argument("--prompts", help="one prompt per line (text, or token ids)")
    parser.add_argument("--max-model-len", type=int, default=4096)
    args = parser.parse_args(argv)
    try:
        if args.model:
            if not args.prompts:
                raise ValueError("--prompts: needed with --model")
            _record_with_vllm(args.model, args.prompts, args.amax, args.max_model_len)
        written = _ext.calibrate(args.amax, args.format, args.granularity, args.headroom,
                                 args.out)
    except ValueError as e:
        print(f"mjolnir.calibrate: error: {e}", file=sys.stderr)
        return 2
    k = [s for layer in written["layers"] for s in layer[0]]
    print(f"mjolnir.calibrate: {len(written['layers'])} layers x {written['num_kv_heads']} KV "
          f"heads x {written['head_dim']} channels -> {written['format']} scales "
          f"({written['granularity']}, headroom {written['headroom']}), K scales "
          f"{min(k):.3g}..{max(k):.3g}, written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
