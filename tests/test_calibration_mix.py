"""Calibration mixtures (issue 26): ``--calib-dataset NAME[:WEIGHT],...`` parsing, the windows each dataset gets, the
shuffle that mixes them, the default English + Chinese mixture (whose Chinese half is never the evaluation half), and
bad specs refused before any work with a message naming the fix."""
from __future__ import annotations

import pytest
import torch

import calib_data
from lite.calibration import DEFAULT_CALIB_DATASET, calibration_samples, mixture_counts, parse_mixture
from lite.formats import LiteturboError


@pytest.fixture(scope="module")
def tok():
    from lite.formats import resolve_model
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(resolve_model(None)))
    except LiteturboError as e:
        pytest.skip(f"needs the SmolLM2 tokenizer: {e}")


def test_parse_mixture_reads_names_weights_and_paths():
    assert parse_mixture("c4") == [("c4", 1.0)]
    assert parse_mixture("c4:3, zh:1") == [("c4", 3.0), ("zh", 1.0)]
    assert parse_mixture("c4,/data/my:file.txt:0.5") == [("c4", 1.0), ("/data/my:file.txt", 0.5)]
    assert parse_mixture("notes:v2.txt") == [("notes:v2.txt", 1.0)]  # a suffix that is no number is the name's
    assert parse_mixture(" c4 : 3 , zh : 1 ") == [("c4", 3.0), ("zh", 1.0)]  # spaces around ':' and ',' are dropped
    with pytest.raises(LiteturboError, match="no dataset name before ':'"):
        parse_mixture(":3")
    for bad, says in [("", "empty"), ("c4,,zh", "empty item"), ("c4:0", "positive"), ("c4:-1", "positive"),
                      ("c4:nan", "positive"), ("c4:inf", "positive"), ("c4,c4:2", "twice")]:
        with pytest.raises(LiteturboError, match=says):
            parse_mixture(bad)


def test_mixture_counts_share_windows_by_weight_and_give_each_one():
    assert mixture_counts([3, 1], 128) == [96, 32]
    assert mixture_counts([1, 1, 1], 10) in ([4, 3, 3], [3, 4, 3], [3, 3, 4])
    assert sum(mixture_counts([0.001, 1000], 7)) == 7 and min(mixture_counts([0.001, 1000], 7)) == 1
    assert mixture_counts([1, 3, 2], 3) == [1, 1, 1]
    with pytest.raises(LiteturboError, match="fewer than the 3 datasets.*at least 3"):
        mixture_counts([1, 3, 2], 2)


def test_the_default_mixture_holds_both_languages_shuffled_and_never_the_eval_half(tok):
    assert DEFAULT_CALIB_DATASET == "c4:3,zh:1"
    mix = calibration_samples(tok, DEFAULT_CALIB_DATASET, n_samples=16, seqlen=64, seed=0)
    assert len(mix) == 16 and all(t.dtype == torch.long and t.shape[0] == 1 and t.shape[1] <= 64 for t in mix)
    alone = {name: calibration_samples(tok, name, n_samples=k, seqlen=64, seed=0)
             for name, k in (("c4", 12), ("zh", 4))}
    as_lists = sorted(t[0].tolist() for t in mix)
    assert as_lists == sorted(t[0].tolist() for ws in alone.values() for t in ws)  # exactly each dataset's share
    zh_first = [t[0].tolist() for t in alone["zh"]]
    positions = [i for i, t in enumerate(mix) if t[0].tolist() in zh_first]
    assert positions != [12, 13, 14, 15]  # shuffled together, not appended
    # the calibration half of the Chinese text shares no paragraph with the evaluation half
    text = tok.decode(torch.cat(alone["zh"], 1)[0])
    eval_paras = calib_data.load_rows("zh", "eval")
    assert not any(p[:40] in text for p in eval_paras)
    again = calibration_samples(tok, DEFAULT_CALIB_DATASET, n_samples=16, seqlen=64, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(mix, again))


def test_a_bad_calib_dataset_is_refused_before_any_work(tmp_path):
    from lite.pipeline import PipelineConfig

    for spec, says in [("c4:3,nowhere.txt", "nowhere.txt"), ("c4:x:y,", "empty item"), ("zh:0", "positive"),
                       ("c4:abc", "suffix must be a positive number"), ("C4", "names are lower case"),
                       ("c4:", "suffix must be a positive number")]:
        with pytest.raises(LiteturboError, match=says):
            PipelineConfig(method="gptq", calib_dataset=spec)
    with pytest.raises(LiteturboError, match="--calib-samples 2 is fewer than the 3 datasets"):
        PipelineConfig(method="awq", calib_dataset="c4,zh,wikitext2", calib_samples=2)
    # the default mixture, which the user did not choose, falls back to its heaviest dataset instead, and says so
    one = PipelineConfig(method="awq", calib_samples=1)
    assert one.calib_dataset == "c4" and any("c4 alone" in c for c in one.choices)
    PipelineConfig(method="rtn", calib_dataset="unused")  # rtn reads no calibration data
