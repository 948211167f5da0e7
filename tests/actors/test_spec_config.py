"""The speculative config refuses what cannot work, with a message naming the problem."""

import pytest

from actors.draft.config import SpeculativeConfig


def test_valid_configs_parse():
    assert SpeculativeConfig.parse(None) is None
    cfg = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "ngram_max": 5})
    assert (cfg.method, cfg.num_speculative_tokens, cfg.ngram_max) == ("ngram", 3, 5)
    cfg = SpeculativeConfig.parse({"method": "layerskip", "draft_layers": 2})
    assert cfg.draft_layers == 2 and cfg.resolved_draft_cost(8) == 0.25
    assert SpeculativeConfig.parse(cfg) is cfg
    assert SpeculativeConfig.parse({"method": "draft", "model": "/m"}).model == "/m"


@pytest.mark.parametrize("value, message", [
    ({"num_speculative_tokens": 3}, "needs \"method\""),
    ({"method": "medusa"}, "method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2.5}, "num_speculative_tokens"),
    ({"method": "draft"}, "needs \"model\""),
    ({"method": "ngram", "model": "/m"}, "only for speculative method \"draft\""),
    ({"method": "layerskip"}, "draft_layers"),
    ({"method": "layerskip", "draft_layers": 0}, "draft_layers"),
    ({"method": "ngram", "draft_layers": 2}, "only for speculative method \"layerskip\""),
    ({"method": "ngram", "ngram_min": 3, "ngram_max": 2}, "ngram_min"),
    ({"method": "ngram", "disable_batch_size": 0}, "disable_batch_size"),
    ({"method": "ngram", "disable_batch_size": "never"}, "disable_batch_size"),
    ({"method": "ngram", "disable_batch_size": "auto"}, "disable_batch_size"),
    ({"method": "ngram", "k": 3}, "unknown speculative option"),
    ("ngram", "must be a dict"),
])
def test_bad_configs_are_refused(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)


def test_layerskip_must_skip_something():
    cfg = SpeculativeConfig.parse({"method": "layerskip", "draft_layers": 3})
    cfg.check_against_target(4)
    with pytest.raises(ValueError, match="below the target's 3 layers"):
        cfg.check_against_target(3)


def test_serve_flags_build_the_engine_config():
    from gateway.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(["serve", "--speculative-method", "layerskip", "--num-speculative-tokens", "3",
                                      "--speculative-draft-layers", "10"])
    cfg = SpeculativeConfig.parse(engine_kwargs(args)["speculative"])
    assert (cfg.method, cfg.num_speculative_tokens, cfg.draft_layers) == ("layerskip", 3, 10)
    assert engine_kwargs(build_parser().parse_args(["serve"]))["speculative"] is None
    with pytest.raises(ValueError, match="draft_layers"):
        SpeculativeConfig.parse(engine_kwargs(build_parser().parse_args(
            ["serve", "--speculative-method", "layerskip"]))["speculative"])


def test_gateway_exposes_the_spec_counters():
    from actors.messages.front_end import EngineStats
    from gateway.metrics import GatewayMetrics

    m = GatewayMetrics()
    m.update_engine(EngineStats(0, 0, 10, 10, 0, 0, 0, 0, 0, spec_decode_draft_tokens=40,
                                spec_decode_accepted_tokens=25))
    text = m.render()
    assert "matinee_spec_decode_draft_tokens_total 40.0" in text
    assert "matinee_spec_decode_accepted_tokens_total 25.0" in text
