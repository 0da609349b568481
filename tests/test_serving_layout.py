"""The serving layout (turbo/core/serving_layout.py): a W4A16 checkpoint's prepared weights saved beside it and
mapped back give the same logits bit for bit; a stale, damaged or foreign layout is never used; aligned safetensors
files stay readable by safetensors; the CLI packs after quantizing and on request, and refuses what it cannot do."""
from __future__ import annotations

import json
import os

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file

from backends import TorchBackend, cpu_ext
from backends.base import Backend
from backends.torch_backend import W4TilesHandle, W8TilesHandle
from lite.formats import LiteturboError
from lite.formats.writing import PAD_PREFIX, write_safetensors_streamed
from turbo.core import serving_layout
from turbo.core.model import LlamaModel

from conftest import run_turbo_logits

IDS = [5, 17, 9, 33, 2, 64, 80, 11, 7, 3, 90, 45, 21, 8, 15, 99]


@pytest.fixture(scope="module")
def w4(tmp_path_factory):
    """A tiny Llama with tied embeddings quantized to W4A16 g32 (AWQ format) by lite's RTN path (hidden 64: fused
    q/k/v 128 rows)."""
    from lite.pipeline import QuantConfig, quantize_checkpoint
    from tiny_models import build_tiny_llama

    src = build_tiny_llama(tmp_path_factory.mktemp("sl") / "tiny", initializer_range=0.2, tie_word_embeddings=True)
    out = tmp_path_factory.mktemp("sl") / "w4"
    return quantize_checkpoint(str(src), QuantConfig(w_bits=4, w_group_size=32, work_dir=str(out)))


def _logits(model) -> torch.Tensor:
    return run_turbo_logits(model, [IDS[:11], IDS[11:12], IDS[12:]])


def _backend(**kw) -> TorchBackend:
    return TorchBackend("cpu", **kw)


def test_mapped_layout_gives_the_same_logits_as_repacking(w4, tmp_path):
    backend = _backend()
    folder = serving_layout.save(w4, backend, torch.bfloat16, lm_head_int8=True)
    assert folder is not None and (folder / "layout.json").is_file()
    assert folder.parent == w4 / "serving"
    mapped = serving_layout.load(w4, backend, torch.bfloat16, lm_head_int8=True)
    assert mapped is not None and len(mapped.layers) == 2
    fresh = LlamaModel.from_pretrained(w4, backend, torch.bfloat16, lm_head_int8=True)
    assert torch.equal(_logits(mapped), _logits(fresh))
    # every weight tensor starts on a 64-byte boundary (vector loads), and the handles are the backend's own types
    h = mapped.layers[0].qkv.handle
    if cpu_ext.ready() is not None and cpu_ext.ready().has_w4_tiles():
        assert isinstance(h, W4TilesHandle) and all(t.data_ptr() % 64 == 0 for t in h.tiles)
    if backend._w8_tiles:
        assert isinstance(mapped.lm_head.handle, W8TilesHandle) and mapped.lm_head.handle.q.data_ptr() % 64 == 0
    # tied embeddings: the dense head and the embedding table are one tensor in the file, and one in memory
    assert mapped.lm_head_dense.handle[0].data_ptr() == mapped.embed.data_ptr()


def test_the_engine_maps_the_layout_and_decodes_as_before(w4):
    from turbo import Engine, GenerationConfig

    gen = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    serving_layout.save(w4, _backend(), torch.bfloat16, lm_head_int8=True)
    calls = []
    real = serving_layout.load

    def spy(*a, **k):
        calls.append(m := real(*a, **k))
        return m
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(serving_layout, "load", spy)
        mapped = Engine(w4, dtype="bfloat16", max_kv_tokens=256).generate(IDS, gen).token_ids
    assert calls and calls[0] is not None  # the engine took the mapped model
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(serving_layout, "load", lambda *a, **k: None)
        repacked = Engine(w4, dtype="bfloat16", max_kv_tokens=256).generate(IDS, gen).token_ids
    assert mapped == repacked and len(mapped) == 12


def test_stale_foreign_or_damaged_layouts_are_not_used(w4, caplog):
    backend = _backend()
    folder = serving_layout.save(w4, backend, torch.bfloat16, lm_head_int8=True)
    # another key: float32, a dense head, batch-invariant kernels
    assert serving_layout.load(w4, backend, torch.float32, lm_head_int8=True) is None
    assert serving_layout.load(w4, backend, torch.bfloat16, lm_head_int8=False) is None
    assert serving_layout.load(w4, _backend(batch_invariant=True), torch.bfloat16, lm_head_int8=True) is None
    # the checkpoint's weights change after packing: stale
    st = os.stat(w4 / "model.safetensors")
    os.utime(w4 / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    try:
        assert serving_layout.load(w4, backend, torch.bfloat16, lm_head_int8=True) is None
    finally:
        os.utime(w4 / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert serving_layout.load(w4, backend, torch.bfloat16, lm_head_int8=True) is not None
    # a truncated layer file: a warning naming the fix, and no model
    f = folder / "layer-001.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with caplog.at_level("WARNING"):
        assert serving_layout.load(w4, backend, torch.bfloat16, lm_head_int8=True) is None
    assert "damaged serving layout" in caplog.text and "liteturbo pack" in caplog.text
    f.write_bytes(data)
    # a folder without layout.json (an interrupted write) is never read
    (folder / "layout.json").unlink()
    assert serving_layout.load(w4, backend, torch.bfloat16, lm_head_int8=True) is None


def test_swapped_files_or_an_edited_layout_json_are_damaged(w4, caplog):
    """Files swapped by hand (their modification times kept) and a hand-edited layout.json (a group size changed)
    are found at load, warned about and not used; the checkpoint then loads as usual."""
    backend = _backend()
    folder = serving_layout.save(w4, backend, torch.bfloat16, lm_head_int8=True)
    a, b, t = folder / "layer-000.safetensors", folder / "layer-001.safetensors", folder / "swap"
    a.rename(t), b.rename(a), t.rename(b)
    with caplog.at_level("WARNING"):
        assert serving_layout.load(w4, backend, torch.bfloat16, lm_head_int8=True) is None
    assert "modification times" in caplog.text and "liteturbo pack" in caplog.text
    folder = serving_layout.save(w4, backend, torch.bfloat16, lm_head_int8=True)
    meta_file = folder / "layout.json"
    meta = json.loads(meta_file.read_text())
    text = json.dumps(meta).replace('"group_size": {"v": 32}', '"group_size": {"v": 16}', 1)
    assert text != json.dumps(meta)
    meta_file.write_text(text)
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert serving_layout.load(w4, backend, torch.bfloat16, lm_head_int8=True) is None
    assert "digest" in caplog.text
    folder = serving_layout.save(w4, backend, torch.bfloat16, lm_head_int8=True)
    assert serving_layout.load(w4, backend, torch.bfloat16, lm_head_int8=True) is not None


def test_a_killed_writers_folder_is_removed_by_the_next_save(w4):
    backend = _backend()
    parent = w4 / "serving"
    parent.mkdir(exist_ok=True)
    dead = 2**22 + 12345  # above the default pid_max: no such process
    left = parent / f".abc.tmp-{dead}-xyz"
    left.mkdir()
    (left / "layer-000.safetensors").write_bytes(b"x" * 100)
    alive = parent / f".abc.tmp-{os.getpid()}-xyz"  # a writer that still runs is left alone
    alive.mkdir()
    serving_layout.save(w4, backend, torch.bfloat16, lm_head_int8=True)
    assert not left.exists() and alive.exists()
    alive.rmdir()


def test_a_backend_without_a_layout_saves_nothing(w4):
    class NoLayout(TorchBackend):
        def serving_layout_id(self, dtype):
            return Backend.serving_layout_id(self, dtype)
    assert serving_layout.save(w4, NoLayout("cpu"), torch.bfloat16, True) is None
    assert serving_layout.load(w4, NoLayout("cpu"), torch.bfloat16, True) is None


def test_a_handle_the_backend_does_not_list_saves_nothing(w4):
    class Unlisted(TorchBackend):
        def serving_handle_types(self):
            return ()
    before = set((w4 / "serving").iterdir()) if (w4 / "serving").exists() else set()
    assert serving_layout.save(w4, Unlisted("cpu"), torch.bfloat16, True) is None
    after = set((w4 / "serving").iterdir())
    assert {p for p in after - before if p.name.startswith(".")} == set()  # no temporary folder left behind


def test_aligned_safetensors_are_valid_and_aligned(tmp_path):
    tensors = {"a": torch.arange(3, dtype=torch.uint8), "b": torch.randn(5, 7, dtype=torch.bfloat16),
               "c": torch.arange(10, dtype=torch.int64), "d": torch.zeros(0, dtype=torch.float32)}
    path = tmp_path / "x.safetensors"
    write_safetensors_streamed(path, [(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()], tensors.__getitem__,
                               metadata={"k": "v"}, align=64)
    back = load_file(str(path))
    assert all(torch.equal(back[k], t) for k, t in tensors.items())
    pads = [k for k in back if k.startswith(PAD_PREFIX)]
    assert pads and all(back[k].dtype == torch.uint8 and not back[k].any() for k in pads)
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    header = json.loads(path.read_bytes()[8:8 + header_len])
    assert (8 + header_len) % 64 == 0
    assert all(header[k]["data_offsets"][0] % 64 == 0 for k in tensors)
    with safe_open(str(path), "pt") as h:
        assert h.metadata() == {"k": "v"}
    with pytest.raises(ValueError, match="multiple of 8"):
        write_safetensors_streamed(path, [], tensors.__getitem__, align=12)
    with pytest.raises(ValueError, match="reserved"):
        write_safetensors_streamed(path, [(f"{PAD_PREFIX}0", torch.uint8, (3,))], tensors.__getitem__)


def test_cli_packs_after_quantizing_and_on_request(tmp_path):
    from tiny_models import build_tiny_llama
    from turbo.cli import main

    src = build_tiny_llama(tmp_path / "src", initializer_range=0.2)
    runner = CliRunner()
    r = runner.invoke(main, ["lite", "rtn", str(src), "--w-group-size", "32", "--work-dir", str(tmp_path / "a")])
    assert r.exit_code == 0, r.output
    assert "serving layout" in r.output and len(list((tmp_path / "a" / "serving").glob("*/layout.json"))) == 1
    r = runner.invoke(main, ["lite", "rtn", str(src), "--w-group-size", "32", "--work-dir", str(tmp_path / "b"),
                             "--no-serving-layout"])
    assert r.exit_code == 0, r.output
    assert not (tmp_path / "b" / "serving").exists()
    r = runner.invoke(main, ["pack", str(tmp_path / "b"), "--threads", "1"])
    assert r.exit_code == 0, r.output
    assert len(list((tmp_path / "b" / "serving").glob("*/layout.json"))) == 1
    # packing fails after a successful quantization: a warning, exit 0, the checkpoint complete
    from turbo.core import serving_layout as sl

    def broken(*a, **k):
        raise LiteturboError("cannot write the serving layout into X (No space left on device)")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sl, "save", broken)
        r = runner.invoke(main, ["lite", "rtn", str(src), "--w-group-size", "32", "--work-dir", str(tmp_path / "c")])
    assert r.exit_code == 0 and "warning:" in r.output and "liteturbo pack" in r.output
    assert (tmp_path / "c" / "model.safetensors").is_file()
    r = runner.invoke(main, ["pack", str(tmp_path / "nope")])
    assert r.exit_code == 2 and "error:" in r.output
    if os.geteuid() != 0:  # root writes anywhere
        os.chmod(tmp_path / "b", 0o555)
        try:
            r = runner.invoke(main, ["pack", str(tmp_path / "b"), "--dtype", "float32"])
        finally:
            os.chmod(tmp_path / "b", 0o755)
        assert r.exit_code == 2 and "--no-serving-layout" in r.output


def test_changed_checkpoint_while_packing_is_refused(w4, monkeypatch):
    real = serving_layout.fingerprint
    calls = iter(range(100))

    def moving(path):
        fp = real(path)
        return {k: [v[0], v[1] + next(calls)] for k, v in fp.items()}
    monkeypatch.setattr(serving_layout, "fingerprint", moving)
    with pytest.raises(LiteturboError, match="changed while"):
        serving_layout.save(w4, _backend(), torch.float32, lm_head_int8=False)
    assert not [p for p in (w4 / "serving").iterdir() if p.name.startswith(".")]



def test_a_file_where_the_layout_folder_belongs_is_named(w4, tmp_path):
    """A file named ``serving`` in the checkpoint folder: the error names that file and `liteturbo pack`, not a
    permission problem; the file is left as it was."""
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(w4, ck, ignore=shutil.ignore_patterns("serving"))
    (ck / "serving").write_text("junk")
    with pytest.raises(LiteturboError, match=r"serving is a file where a folder belongs.*liteturbo pack"):
        serving_layout.save(ck, _backend(), torch.float32, lm_head_int8=False)
    assert (ck / "serving").read_text() == "junk"
