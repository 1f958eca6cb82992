"""`EngineConfig`: one declaration per knob, validated before anything loads, and the flags and
``/server_info`` derived from it."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from pagedrs import LLM
from pagedrs.cli_args import config_from_args
from pagedrs.config import EngineConfig
from pagedrs.engine import builder
from pagedrs.server.launch import add_serve_arguments
from pagedrs.server.settings import ServerConfig


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(attention_backend="cdua"), "attention_backend must be one of"),
        (dict(dtype="float8"), "dtype must be one of"),
        (dict(max_num_seqs=0), "max_num_seqs must be at least 1"),
        (dict(block_size="16"), "block_size must be an integer"),
        (dict(enable_prefix_caching="yes"), "enable_prefix_caching must be True or False"),
        (dict(kv_cache_memory="lots"), "not a memory size"),
        (dict(device="gpu"), "device must be cpu, cuda or cuda:N"),
        (dict(scheduling_policy="lifo"), "scheduling_policy must be one of"),
        (dict(speculative_config='{"method": "guess"}'), "method must be one of"),
        (dict(tensor_parallel_size=3, nnodes=2), "nnodes must be a positive divisor"),
        (dict(master_port=70000), "master_port must be a TCP port"),
    ],
)
def test_a_bad_setting_is_refused_before_anything_loads(settings, message, monkeypatch):
    def must_not_run(*args, **kwargs):
        raise AssertionError("a checkpoint was opened before the config was checked")

    monkeypatch.setattr(builder, "resolve_model", must_not_run)
    with pytest.raises(ValueError, match=message):
        LLM(**settings)


def test_every_knob_is_a_flag_with_its_default_and_help():
    parser = add_serve_arguments(argparse.ArgumentParser())
    args = parser.parse_args([])
    assert config_from_args(EngineConfig, args) == EngineConfig()
    assert config_from_args(ServerConfig, args) == ServerConfig()
    for config_class in (EngineConfig, ServerConfig):
        for spec in dataclasses.fields(config_class):
            assert spec.metadata.get("help"), f"{spec.name} has no help"
            assert hasattr(args, spec.name), f"{spec.name} has no flag"
    flags = parser.parse_args(
        ["/models/x", "--max-num-seqs", "8", "--no-enable-prefix-caching", "-tp", "2"]
        + ["--scheduling-policy", "priority"]
    )
    config = config_from_args(EngineConfig, flags)
    assert (config.model, config.max_num_seqs, config.enable_prefix_caching) == ("/models/x", 8, False)
    assert (config.tensor_parallel_size, config.scheduling_policy) == (2, "priority")


def test_flags_pass_on_to_a_replica_as_they_were_given():
    """What ``--data-parallel-size`` hands each replica: the same settings, less the front's own."""
    from pagedrs.cli_args import flags_from_args
    from pagedrs.server.data_parallel import FRONT_ONLY

    parser = add_serve_arguments(argparse.ArgumentParser())
    given = ["/models/x", "-dp", "2", "--port", "9000", "--max-num-seqs", "8", "--no-enable-prefix-caching"]
    given += ["--enable-lora", "--lora-modules", "a=/a", "b=/b", "-tp", "2", "--kv-cache-memory", "1GiB"]
    args = parser.parse_args(given)
    passed = flags_from_args(parser, args, skip=FRONT_ONLY)
    assert "--port" not in passed and "2" == passed[passed.index("--tensor-parallel-size") + 1]
    again = parser.parse_args(passed)
    for name, value in vars(args).items():
        assert getattr(again, name) == (parser.get_default(name) if name in FRONT_ONLY else value), name


def test_a_bad_flag_is_a_usage_error(capsys):
    parser = add_serve_arguments(argparse.ArgumentParser())
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--attention-backend", "cdua"])
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit) as exit_info:
        from pagedrs.server.launch import configs

        configs(parser.parse_args(["--speculative-config", "not json"]))
    assert exit_info.value.code == 2
    assert "speculative config is not valid JSON" in capsys.readouterr().err


def test_to_dict_is_json_ready_and_complete():
    import json

    config = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    as_dict = config.to_dict()
    assert set(as_dict) == {spec.name for spec in dataclasses.fields(EngineConfig)}
    assert json.loads(json.dumps(as_dict))["speculative_config"]["num_speculative_tokens"] == 3
