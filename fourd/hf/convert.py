"""Convert Llama checkpoints between Hugging Face (config.json + safetensors) and fourd's format.

Tensors keep their dtype; q and k rows are permuted between Meta's interleaved rotary pairs and Hugging
Face's halves, exactly. Only safetensors are read. An export carries the run's tokenizer file.

examples:
  fourd convert --from hf ./Llama-3-8B --to fourd ./ckpt/llama3-8b
  fourd convert --from fourd runs/demo/checkpoints/step-4 --to hf ./export --shard-mb 5000
  fourd convert --from fourd runs/demo --to hf ./export     # a run directory: its newest checkpoint
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from fourd.errors import FourdError
from fourd.model.config import ModelConfig

if TYPE_CHECKING:
    import torch

ARCHITECTURE = "LlamaForCausalLM"
INDEX = "model.safetensors.index.json"
# LlamaConfig's defaults, for a config.json that omits the key.
_HF_DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 2048}
# Tensors Hugging Face checkpoints sometimes carry that are recomputed, not learned.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Tokenizer kinds (fourd.data.tokenizer names) and the file name Hugging Face and Meta give each.
_TOKENIZER_FILES = {"tokenizer.json": "tokenizer.json", "tiktoken": "tokenizer.model"}


def add_arguments(p) -> None:
    p.add_argument("--from", dest="src_format", required=True, choices=("hf", "fourd"), help="format of SRC")
    p.add_argument("src", metavar="SRC", help="directory to read (fourd: a checkpoint or a run directory)")
    p.add_argument("--to", dest="dst_format", required=True, choices=("hf", "fourd"), help="format of DST")
    p.add_argument("dst", metavar="DST", help="directory to create (must not exist)")
    p.add_argument(
        "--shard-mb", type=int, default=5000, help="Hugging Face export: largest safetensors file in MB (default 5000)"
    )


def run(args) -> int:
    if args.shard_mb < 1:
        raise FourdError(f"--shard-mb {args.shard_mb} must be at least 1 (MB per safetensors file)")
    if (args.src_format, args.dst_format) == ("hf", "fourd"):
        cfg, _ = hf_to_fourd(args.src, args.dst)
    elif (args.src_format, args.dst_format) == ("fourd", "hf"):
        cfg = fourd_to_hf(args.src, args.dst, shard_bytes=args.shard_mb * 1_000_000)
    else:
        raise FourdError(f"--from {args.src_format} --to {args.dst_format}: convert between hf and fourd, one each way")
    print(f"wrote {args.dst} ({args.dst_format}): {cfg.layers} layers, dim {cfg.dim}, {cfg.params():,} parameters")
    return 0


# ---- names and the rotary layout -------------------------------------------------------------------

_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
_TOP["output.weight"] = "lm_head.weight"
_BLOCK = {"attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_BLOCK |= {f"attention.w{x}": f"self_attn.{x}_proj" for x in "qkvo"}
_BLOCK |= {"feed_forward.w1": "mlp.gate_proj", "feed_forward.w2": "mlp.down_proj", "feed_forward.w3": "mlp.up_proj"}


def hf_name(name: str) -> str:
    """fourd (Meta) parameter name -> Hugging Face name, e.g. layers.3.feed_forward.w1.weight ->
    model.layers.3.mlp.gate_proj.weight."""
    if name in _TOP:
        return _TOP[name]
    _, i, rest = name.split(".", 2)
    return f"model.layers.{i}.{_BLOCK[rest.removesuffix('.weight')]}.weight"


def interleaved_to_halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q or k projection, per head, from pairs (2i, 2i+1) to halves (i, i + d/2) (docs/hf.md)."""
    rows, cols = w.shape
    return w.reshape(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols).contiguous()


def halves_to_interleaved(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of interleaved_to_halves."""
    rows, cols = w.shape
    return w.reshape(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols).contiguous()


def _rotary(cfg: ModelConfig, name: str, w: torch.Tensor, permute) -> torch.Tensor:
    if name.endswith(("wq.weight", "wk.weight")):
        return permute(w, cfg.heads if name.endswith("wq.weight") else cfg.kv_heads)
    return w


# ---- Hugging Face -> fourd -------------------------------------------------------------------------


def _json_object(path: Path, what: str) -> dict:
    from fourd.data.corpus import read_regular

    try:
        obj = json.loads(read_regular(path, what, "give a Hugging Face model directory"))
    except (ValueError, RecursionError) as e:
        raise FourdError(f"{path}: not valid JSON ({str(e)[:80]})") from None
    if not isinstance(obj, dict):
        raise FourdError(f"{path}: not a JSON object; give a Hugging Face {what}")
    return obj


def _field(path: Path, hf: dict, key: str, default, kind: type):
    value = hf.get(key) if hf.get(key) is not None else default
    if kind is int and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise FourdError(f"{path}: field {key!r} missing or not a positive integer")
    if kind is float and (not isinstance(value, (int, float)) or isinstance(value, bool)):
        raise FourdError(f"{path}: field {key!r} = {value!r} is not a number")
    return kind(value)


def read_hf_config(src: Path) -> tuple[ModelConfig, dict]:
    path = src / "config.json"
    hf = _json_object(path, "config.json")
    arch = hf.get("architectures") or [hf.get("model_type")]
    if not isinstance(arch, list) or not arch or (ARCHITECTURE not in arch and arch != ["llama"]):
        shown = arch[0] if isinstance(arch, list) and arch else arch
        raise FourdError(f"{path}: architecture {shown!r} is not supported; fourd converts {ARCHITECTURE} only")
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if hf.get(key, want) != want:
            raise FourdError(f"{path}: field {key!r} = {hf[key]!r} is not supported (fourd's Llama has {want!r})")
    rope = hf.get("rope_parameters") or {}
    if hf.get("rope_scaling") or not isinstance(rope, dict) or rope.get("rope_type", "default") != "default":
        what = f"'rope_scaling' = {hf['rope_scaling']!r}" if hf.get("rope_scaling") else f"'rope_parameters' = {rope!r}"
        raise FourdError(f"{path}: field {what} is not supported; fourd implements plain RoPE")
    dim, heads = _field(path, hf, "hidden_size", None, int), _field(path, hf, "num_attention_heads", None, int)
    cfg = ModelConfig(
        layers=_field(path, hf, "num_hidden_layers", None, int),
        dim=dim,
        ffn=_field(path, hf, "intermediate_size", None, int),
        heads=heads,
        kv_heads=_field(path, hf, "num_key_value_heads", heads, int),
        vocab=_field(path, hf, "vocab_size", None, int),
        head_dim=_field(path, hf, "head_dim", dim // heads, int),
        norm_eps=_field(path, hf, "rms_norm_eps", _HF_DEFAULTS["rms_norm_eps"], float),
        rope_theta=_field(path, {**hf, **rope}, "rope_theta", _HF_DEFAULTS["rope_theta"], float),
        max_seq=_field(path, hf, "max_position_embeddings", _HF_DEFAULTS["max_position_embeddings"], int),
    )
    return cfg, hf


def _safetensors_files(src: Path) -> list[Path]:
    from fourd.ckpt.store import inside

    if (src / INDEX).is_file():
        weight_map = _json_object(src / INDEX, INDEX).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise FourdError(f"{src / INDEX}: no valid 'weight_map'; the index is damaged")
        files = [inside(src, f, str(src / INDEX)) for f in sorted(set(map(str, weight_map.values())))]
    else:
        files = sorted(src.glob("*.safetensors"))
    if not files:
        bins = sorted(p.name for p in src.glob("*.bin"))
        hint = f" ({bins[0]} is a pickle, which fourd does not load; save the model with safe_serialization)"
        raise FourdError(f"{src}: no .safetensors files{hint if bins else ''}")
    for f in files:
        if not f.is_file():  # a FIFO or device would block or never end
            raise FourdError(f"{f}: missing or not a regular file (named in {INDEX})")
    return files


def read_hf_tensors(src: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    tensors: dict[str, torch.Tensor] = {}
    for f in _safetensors_files(src):
        try:
            with safe_open(str(f), framework="pt") as st:
                for k in st.keys():  # noqa: SIM118 - safe_open is not iterable
                    if k in tensors:
                        raise FourdError(f"{f}: tensor {k} also appears in another file")
                    tensors[k] = st.get_tensor(k)
        except (SafetensorError, OSError) as e:
            raise FourdError(f"{f}: not a readable safetensors file ({str(e)[:80]})") from None
    return tensors


def hf_to_fourd_state_dict(cfg: ModelConfig, hf: dict, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from fourd.ckpt.store import shapes

    tensors = {k: v for k, v in tensors.items() if not k.endswith(_IGNORED_SUFFIXES)}
    if hf.get("tie_word_embeddings") and "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors:
        # Tied models (Llama 3.2 1B/3B) store one matrix; fourd's output projection gets its own copy.
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    if cfg.layers > len(tensors):  # checked before a model of that depth is built, even on the meta device
        raise FourdError(f"config.json says {cfg.layers} layers; the safetensors files hold {len(tensors)} tensors")
    sd = {}
    for name, shape in shapes(cfg).items():
        hname = hf_name(name)
        if hname not in tensors:
            raise FourdError(f"tensor {hname} missing from the safetensors files (config.json implies it)")
        w = tensors.pop(hname)
        if tuple(w.shape) != shape:
            raise FourdError(f"tensor {hname} has shape {list(w.shape)}; config.json implies {list(shape)}")
        sd[name] = _rotary(cfg, name, w, halves_to_interleaved)
    if tensors:
        raise FourdError(
            f"tensor {sorted(tensors)[0]} is not part of a {ARCHITECTURE} "
            f"({len(tensors)} unexpected tensor(s)); fourd would drop it"
        )
    return sd


def read_hf(src: str | os.PathLike) -> tuple[ModelConfig, dict, dict[str, torch.Tensor]]:
    """A Hugging Face Llama directory: its ModelConfig, config.json, and tensors under fourd's names."""
    src = Path(src)
    if not src.is_dir():
        raise FourdError(f"{src}: not a directory; give a Hugging Face model directory")
    cfg, hf = read_hf_config(src)
    return cfg, hf, hf_to_fourd_state_dict(cfg, hf, read_hf_tensors(src))


def load_hf(src: str | os.PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A Hugging Face Llama directory as (ModelConfig, state dict in fourd's names, float32 on the CPU)."""
    cfg, _, sd = read_hf(src)
    return cfg, {k: v.float() for k, v in sd.items()}


def hf_to_fourd(src: str | os.PathLike, dst: str | os.PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from fourd.ckpt import store

    cfg, hf, sd = read_hf(src)
    store.save_model_checkpoint(dst, cfg, sd, extra={"hf_config": hf})
    return cfg, sd


# ---- fourd -> Hugging Face -------------------------------------------------------------------------


def hf_config(cfg: ModelConfig, dtype: torch.dtype, base: dict | None = None) -> dict:
    """config.json for `cfg`; `base` (the imported model's own config) keeps its other keys, e.g. token ids."""
    dtype_name = str(dtype).removeprefix("torch.")
    out = dict(base or {"bos_token_id": None, "eos_token_id": None})
    out.pop("rope_scaling", None)
    out |= {"architectures": [ARCHITECTURE], "model_type": "llama", "hidden_act": "silu", "attention_bias": False}
    out |= {"mlp_bias": False, "tie_word_embeddings": False, "hidden_size": cfg.dim, "intermediate_size": cfg.ffn}
    out |= {"num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads}
    out |= {"head_dim": cfg.head_dim, "vocab_size": cfg.vocab, "rms_norm_eps": cfg.norm_eps}
    # Older readers take rope_theta at the top, newer ones from rope_parameters.
    out |= {"max_position_embeddings": cfg.max_seq, "rope_theta": cfg.rope_theta, "torch_dtype": dtype_name}
    out |= {"rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta}, "dtype": dtype_name}
    return out


def _shard(tensors: dict[str, torch.Tensor], shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k in sorted(tensors):
        n = tensors[k].numel() * tensors[k].element_size()
        if shards[-1] and size + n > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = tensors[k]
        size += n
    return shards


def _tokenizer_file(manifest: dict) -> tuple[str, bytes] | None:
    """(file name, bytes) of the tokenizer file the run trained with; None for byte-level or unrecorded runs."""
    from fourd.data.corpus import read_regular
    from fourd.data.tokenizer import load_tokenizer

    data = manifest.get("train", {}).get("data", {})
    spec = data.get("tokenizer", "byte")
    if spec in ("", "byte"):
        return None
    tok = load_tokenizer(spec)
    if "identity" in data and tok.identity() != data["identity"]:
        raise FourdError(f"tokenizer {spec!r} changed since the run trained with it; restore the file it used")
    return _TOKENIZER_FILES[tok.name], read_regular(spec, "tokenizer", "restore the file the run trained with")


def write_hf(dst: Path, config: dict, tensors: dict[str, torch.Tensor], shard_bytes: int, extra=None) -> None:
    """config.json, safetensors (sharded with an index past `shard_bytes`) and `extra` {name: bytes} files,
    renamed into place at the end; files get the usual mode (0644 under umask 022)."""
    from safetensors.torch import save_file

    from fourd.ckpt.store import staging_dir

    if dst.exists():
        raise FourdError(f"{dst} already exists; remove it or choose another destination")
    tmp = staging_dir(dst)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        shards = _shard(tensors, shard_bytes)
        names = [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
        names = names if len(shards) > 1 else ["model.safetensors"]
        for name, shard in zip(names, shards):
            save_file(shard, str(tmp / name), metadata={"format": "pt"})
        files = dict(extra or {}, **{"config.json": json.dumps(config, indent=2, sort_keys=True) + "\n"})
        if len(shards) > 1:
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            weight_map = {k: name for name, shard in zip(names, shards) for k in shard}
            files[INDEX] = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        for name, content in files.items():
            (tmp / name).write_bytes(content if isinstance(content, bytes) else content.encode())
        umask = os.umask(0)
        os.umask(umask)
        for p in tmp.iterdir():  # safetensors writes 0600
            p.chmod(0o666 & ~umask)
        os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def fourd_to_hf(src: str | os.PathLike, dst: str | os.PathLike, shard_bytes: int = 5_000_000_000) -> ModelConfig:
    from fourd.ckpt import store

    src = store.resolve(src)
    cfg, sd = store.load_model_checkpoint(src)
    if cfg.mlp != "swiglu":
        raise FourdError(f"{src}: model.mlp = {cfg.mlp!r}; only Llama (swiglu) models export to Hugging Face")
    manifest = store.read_manifest(src)
    tokenizer = _tokenizer_file(manifest)
    tensors = {hf_name(k): _rotary(cfg, k, v, interleaved_to_halves).contiguous() for k, v in sd.items()}
    config = hf_config(cfg, sd["tok_embeddings.weight"].dtype, manifest.get("hf_config"))
    write_hf(Path(dst), config, tensors, shard_bytes, extra=dict([tokenizer]) if tokenizer else None)
    return cfg
