"""AWQ calibrated for generation (harness/quant_calibration.py): the greedy score counts equal tokens position by
position against the unquantized model's run, and the calibrated model is an AWQ model of the training split."""
import pytest
import torch

import zoo
from harness import Engine
from harness.quant_calibration import Calibration, awq_quantize, greedy_agreement
from helpers import greedy, make_prompts, random_model


def test_greedy_agreement_counts_equal_tokens_position_by_position():
    model, other = random_model("gqa", seed=1), random_model("gqa", seed=2)
    prompts = make_prompts([8] * 5, model.config.vocab_size, seed=3)
    score = greedy_agreement(model, prompts, 12)
    assert score(model) == 1.0
    want, got = (Engine(m, max_batch=5, max_seq_len=20).generate(prompts, greedy(12)) for m in (model, other))
    same = sum(a == b for x, y in zip(want, got) for a, b in zip(x.token_ids, y.token_ids))
    assert same < 60 and score(other) == same / 60


def test_awq_quantize_calibrates_on_the_training_split(tmp_path):
    """A corpus file's last 5% is its validation split; here it holds byte 200, which a 128-token vocabulary lacks,
    so a calibration window or prompt drawn from it would be an out-of-vocabulary error."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(bytes(range(97, 123)) * 400 + bytes([200]) * 400)
    model = random_model("gqa", seed=4, vocab_size=128)
    config = zoo.QuantizeConfig("int4", group_size=32, method="awq")
    quantized = awq_quantize(model, config, corpus, Calibration(windows=4, context=64, prompts=4, prompt_len=8,
                                                                new_tokens=8))
    assert quantized.quantization == config
    with pytest.raises(ValueError, match="200"):  # the validation byte, had it been drawn
        zoo.quantize(model, config, torch.full((1, 8), 200))
