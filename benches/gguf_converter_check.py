"""Every GGUF architecture ferrobatch loads, on files llama.cpp's own converter wrote.

The tests write their GGUF files with gguf-py the way `convert_hf_to_gguf.py` does
(`tests/gguf/gguf_files.py`); this check takes the converter itself. Per architecture: a
tiny random transformers model (the tests' configs) with a real tokenizer (SmolLM2's BPE
one, whose pre-tokenizer the converter knows; a small SentencePiece model trained here for
the architectures the converter reads SentencePiece for) is saved, converted to an F32 and
a Q8_0 GGUF by `convert_hf_to_gguf.py`, and loaded by ferrobatch on the reference products:

* F32 file: logits against the transformers model itself (the same values: checks the
  tensor names, row orders and the config ferrobatch makes of the metadata);
* Q8_0 file: every quantized matrix ferrobatch keeps, dequantized, against the tensor
  transformers' own GGUF loader (`from_pretrained(gguf_file=...)`, gguf-py's
  dequantization) puts in its place, where that loader places it (it drops some
  architectures' experts and metadata: Mixtral files load as Llama, Gemma 2's softcaps and
  StarCoder2's rope theta fall back to defaults, so its logits are no oracle);
* `Engine(FILE)` on the Q8_0 file, greedy tokens for two prompts, each against
  `model.generate` of ferrobatch's own model of the file alone (reference products).

    export LLAMACPP_SRC=/path/to/llama.cpp      # benches/peers/setup_llamacpp.sh unpacks one
    .venv/bin/python benches/gguf_converter_check.py --work /tmp/conv [--archs qwen3 gemma3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "tests" / "gguf"))

from ferrobatch.gguf import modules  # noqa: E402, I001  (before torch: OpenMP settings)
import torch  # noqa: E402
import transformers  # noqa: E402
from gguf_files import tiny_model  # noqa: E402

#: architectures whose converter reads a SentencePiece `tokenizer.model` (the others: BPE)
SENTENCEPIECE = ("llama", "mixtral", "gemma2", "gemma3", "phi3", "nemotron")
ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "gpt2",
         "starcoder2", "nemotron", "qwen2moe", "qwen3moe", "mixtral", "gpt-oss")
PROMPTS = [[1, 17, 99, 5, 200, 7, 8], [1, 300, 301, 9]]
IDS = torch.tensor([[1, 17, 99, 5, 200, 7, 8, 300, 11, 400]])
NEW = 8


def _spm(work: Path, text: Path) -> Path:
    """A 512-piece SentencePiece model (ids: pad 0, bos 1, eos 2, unk 3, as the tiny
    configs), trained once on `text`."""
    out = work / "spm" / "sp.model"
    if not out.is_file():
        import sentencepiece as spm

        out.parent.mkdir(parents=True, exist_ok=True)
        spm.SentencePieceTrainer.train(
            input=str(text), model_prefix=str(out.with_suffix("")), vocab_size=512,
            model_type="bpe", pad_id=0, bos_id=1, eos_id=2, unk_id=3, byte_fallback=True,
            character_coverage=1.0, minloglevel=2)
    return out


def _save(arch: str, work: Path, bpe_dir: Path,
          qwen_dir: Path | None) -> tuple[Path, transformers.PreTrainedModel]:
    """The tiny model of `arch` with its tokenizer (Qwen's for the Qwen architectures where
    `qwen_dir` has one: the converter recognizes a Qwen file's pre-tokenizer by the hash of
    Qwen's), saved as a checkpoint directory."""
    d = work / arch / "hf"
    if d.exists():
        shutil.rmtree(d)
    if arch in SENTENCEPIECE:
        model = tiny_model(arch)
        model.save_pretrained(d)
        shutil.copy(_spm(work, ROOT / "README.md"), d / "tokenizer.model")
    else:
        tok_dir = qwen_dir if arch.startswith("qwen") and qwen_dir is not None else bpe_dir
        vocab = len(transformers.AutoTokenizer.from_pretrained(tok_dir))
        # (GPT-2's converter writes a feed-forward width of 4 x hidden, as every GPT-2 has)
        extra = {"n_inner": None} if arch == "gpt2" else {}
        model = tiny_model(arch, vocab_size=vocab, **extra)
        model.save_pretrained(d)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tok_dir / name, d / name)
    if arch == "gpt2":  # (the converter reads GPT-2's context from `n_ctx`)
        config = json.loads((d / "config.json").read_text())
        config.setdefault("n_ctx", config["n_positions"])
        (d / "config.json").write_text(json.dumps(config, indent=2))
    return d, model


def _convert(src: Path, hf: Path, outtype: str) -> Path:
    out = hf.parent / f"{hf.parent.name}-{outtype}.gguf"
    env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}
    run = subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(hf),
                          "--outtype", outtype, "--outfile", str(out)],
                         env=env, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(run.stderr.strip().splitlines()[-1] if run.stderr else "failed")
    return out


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.inference_mode():
        return model(IDS).logits[0].float()


def _weights_equal(ours: torch.nn.Module, theirs: torch.nn.Module) -> tuple[int, int]:
    """(quantized matrices compared, those that differ) between ferrobatch's model and
    transformers' model of the same file."""
    from ferrobatch.gguf.modules import QuantEmbedding, QuantLinear

    params = dict(theirs.named_parameters(remove_duplicate=False))
    seen = differ = 0
    for name, mod in ours.named_modules():
        if not isinstance(mod, QuantLinear | QuantEmbedding):
            continue
        t = params.get(f"{name}.weight")
        if t is None:
            continue
        w = torch.as_tensor(modules._dequantized(mod.weight_q)).reshape(t.shape)
        seen += 1
        differ += int(not torch.equal(w, t.detach().float()))
    return seen, differ


def check(arch: str, src: Path, work: Path, bpe_dir: Path, qwen_dir: Path | None) -> str:
    """One architecture's line of the report."""
    from ferrobatch import Engine, SamplingParams
    from ferrobatch.gguf.loader import load_gguf

    hf, model = _save(arch, work, bpe_dir, qwen_dir)
    f32, q8 = _convert(src, hf, "f32"), _convert(src, hf, "q8_0")
    with modules.backend("reference"):
        ours, _ = load_gguf(f32)
        d_f32 = (_logits(ours) - _logits(model)).abs().max().item()
        ours, _ = load_gguf(q8)
        try:
            theirs = transformers.AutoModelForCausalLM.from_pretrained(
                str(q8.parent), gguf_file=q8.name, dtype=torch.float32).eval()
            seen, differ = _weights_equal(ours, theirs)
            weights = f"{seen - differ} of {seen}"
        except Exception as exc:  # noqa: BLE001 - transformers' loader fails on some files
            seen, differ = -1, 0
            weights = f"transformers' loader fails ({type(exc).__name__})"
        want = []
        for p in PROMPTS:
            with torch.inference_mode():
                out = ours.generate(torch.tensor([p]), max_new_tokens=NEW,
                                    min_new_tokens=NEW, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)
            want.append(out[0, len(p):].tolist())
        with Engine(str(q8)) as engine:
            got = [o.token_ids for o in engine.generate(
                PROMPTS, SamplingParams(max_new_tokens=NEW, ignore_eos=True), progress=False)]
    same = got == want
    ok = d_f32 <= 1e-4 and seen != 0 and differ == 0 and same
    return (f"{arch:<11} {'ok' if ok else 'DIFFERS':<8} f32 file vs the transformers model: "
            f"max|d| {d_f32:.1e}; q8_0 matrices equal to transformers' GGUF loader's: "
            f"{weights}; engine greedy {'equal' if same else 'differs'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True, help="scratch directory")
    ap.add_argument("--archs", nargs="+", default=list(ARCHS), choices=ARCHS)
    ap.add_argument("--bpe-tokenizer", type=Path, default=None,
                    help="a directory with SmolLM2's tokenizer.json (default: the bundled "
                    "model's, prepared by ferrobatch.models.bundled_model_dir)")
    ap.add_argument("--qwen-tokenizer", type=Path, default=None,
                    help="a directory with a Qwen2.5 tokenizer.json for the Qwen architectures "
                    "(default: SmolLM2's, which the converter does not take for qwen2)")
    args = ap.parse_args()
    src = Path(os.environ.get("LLAMACPP_SRC", ""))
    if not (src / "convert_hf_to_gguf.py").is_file():
        raise SystemExit("convert_hf_to_gguf.py not found: set LLAMACPP_SRC to llama.cpp's "
                         "source tree")
    os.environ.setdefault("FERROBATCH_CACHE", str(args.work / "cache"))
    torch.set_num_threads(1)
    if args.bpe_tokenizer is None:
        from ferrobatch.models import bundled_model_dir

        args.bpe_tokenizer = bundled_model_dir()
    failed = False
    for arch in args.archs:
        try:
            line = check(arch, src, args.work, args.bpe_tokenizer, args.qwen_tokenizer)
        except Exception as exc:  # noqa: BLE001 - report the architecture and go on
            line = f"{arch:<11} ERROR    {type(exc).__name__}: {exc}"
        failed |= " ok " not in line
        print(line, flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
