"""Configuration: presets, CLI overrides and refusals, with exact values."""

import pytest

from kvserve.configs import ConfigError, EngineConfig, HTTPConfig, load_config


def test_packaged_default_preset_and_overrides():
    cfg = load_config("default", {"http.port": 9001, "model.model": None})
    assert (cfg.http.host, cfg.http.port) == ("127.0.0.1", 9001)
    assert cfg.model.model is None and cfg.engine.max_tokens == 512


def test_file_values_and_unknown_keys(tmp_path):
    preset = tmp_path / "mine.toml"
    preset.write_text('[engine]\nmax_tokens = 7\n[http]\nport = 1234\n')
    cfg = load_config(preset, {"http.port": 4321})
    assert (cfg.engine.max_tokens, cfg.http.port) == (7, 4321)
    preset.write_text('[engine]\nmax_tokenz = 7\n')
    with pytest.raises(ConfigError, match=r"unknown key\(s\) in \[engine\]: max_tokenz"):
        load_config(preset)


@pytest.mark.parametrize("kwargs", [{"max_tokens": 0}, {"prefill_step_size": 0},
                                    {"max_tokens": 10, "max_tokens_limit": 5}, {"queue_timeout_s": -1}])
def test_engine_config_refuses_bad_values(kwargs):
    with pytest.raises(ConfigError):
        EngineConfig(**kwargs)


def test_missing_preset_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: nope"):
        load_config("nope")
    bad = tmp_path / "bad.toml"
    bad.write_text("[engine\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(bad)


def test_waiting_limits_default_and_refusals():
    cfg = load_config("default", {"engine.queue_timeout_s": 0})
    assert (cfg.engine.queue_timeout_s, cfg.http.sse_keepalive_s) == (0, 15.0)  # 0: no limit
    assert load_config("default").engine.queue_timeout_s == 600.0 == EngineConfig().queue_timeout_s
    with pytest.raises(ConfigError, match="http.sse_keepalive_s must be > 0"):
        HTTPConfig(sse_keepalive_s=0)


@pytest.mark.parametrize("kwargs,message", [
    ({"speculative": "draft"}, "engine.speculative = draft needs engine.draft_model"),
    ({"draft_model": "m"}, "engine.speculative = draft needs engine.draft_model, and engine.draft_model needs it"),
    ({"speculative": "draft", "draft_model": "m", "distributed": True}, "cannot be used with engine.distributed"),
    ({"speculative": "eagle"}, "engine.speculative must be off, ngram or draft, got 'eagle'"),
    ({"draft_cost": -0.1}, "engine.draft_cost must be >= 0"),
])
def test_speculative_settings_refused_with_their_reason(kwargs, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        EngineConfig(**kwargs)
    assert EngineConfig(speculative="draft", draft_model="m").draft_model == "m"


def test_prompt_cache_ram_defaults_to_a_share_of_memory_and_zero_turns_it_off():
    from kvserve.configs import CacheConfig

    cfg = load_config("default", {})
    assert cfg.cache.prompt_cache_ram_gb is None and cfg.cache.prefix_enabled
    assert load_config("default", {"cache.prompt_cache_ram_gb": 2.5}).cache.prompt_cache_ram_gb == 2.5
    assert not CacheConfig(prompt_cache_ram_gb=0, prompt_cache_disk_gb=0).prefix_enabled
    assert CacheConfig(prompt_cache_ram_gb=None, prompt_cache_disk_gb=0).prefix_enabled
    with pytest.raises(ConfigError, match="cache.prompt_cache_ram_gb must be >= 0"):
        CacheConfig(prompt_cache_ram_gb=-1)
