"""kv_transfer_params and --kv-transfer-config: what is accepted, and the errors for the rest."""
import json

import pytest

from m3serve.config import EngineConfig, KVTransferConfig
from m3serve.kv_transfer_params import parse_kv_transfer_params, producer_params, prompt_hash

DECODE_LEG = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [3, 4, 9],
              "remote_engine_id": "e1", "remote_request_id": "cmpl-1-0", "remote_host": "10.0.0.2",
              "remote_port": 5601, "tp_size": 2, "prompt_hash": "ab"}


def test_router_prefill_leg_is_accepted():
    # what vllm-router and smg add to the prefill leg
    p = parse_kv_transfer_params({"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                  "remote_block_ids": None, "remote_host": None, "remote_port": None})
    assert p.do_remote_decode and not p.do_remote_prefill
    assert parse_kv_transfer_params(None) is None


def test_decode_leg_round_trips_and_ignores_unknown_keys():
    p = parse_kv_transfer_params({**DECODE_LEG, "transfer_id": "x", "future_key": [1]})
    assert p.remote_block_ids == [3, 4, 9] and p.remote_port == 5601 and p.tp_size == 2
    assert p.remote_address == "tcp://10.0.0.2:5601"


def test_producer_params_feed_the_decode_leg():
    out = producer_params([1, 2], "e", "r", "h", 7, 1, [5, 6, 7])
    assert parse_kv_transfer_params(json.loads(json.dumps(out))).prompt_hash == prompt_hash([5, 6, 7])
    assert prompt_hash([5, 6, 7]) != prompt_hash([5, 6, 8])


@pytest.mark.parametrize("raw, names", [
    ("yes", "must be a JSON object"),
    ({"do_remote_decode": "true"}, "kv_transfer_params.do_remote_decode"),
    ({"do_remote_decode": True, "do_remote_prefill": True}, "cannot both be true"),
    ({**DECODE_LEG, "remote_block_ids": None}, "needs remote_block_ids"),
    ({"do_remote_prefill": True}, "needs remote_block_ids, remote_engine_id, remote_request_id, remote_host, remote_port"),
    ({**DECODE_LEG, "remote_block_ids": []}, "kv_transfer_params.remote_block_ids"),
    ({**DECODE_LEG, "remote_block_ids": [1, -2]}, "kv_transfer_params.remote_block_ids"),
    ({**DECODE_LEG, "remote_block_ids": [1, True]}, "kv_transfer_params.remote_block_ids"),
    ({**DECODE_LEG, "remote_port": 70000}, "kv_transfer_params.remote_port"),
    ({**DECODE_LEG, "remote_port": "5601"}, "kv_transfer_params.remote_port"),
    ({**DECODE_LEG, "remote_host": ""}, "kv_transfer_params.remote_host"),
    ({**DECODE_LEG, "remote_engine_id": 5}, "kv_transfer_params.remote_engine_id"),
    ({**DECODE_LEG, "tp_size": 0}, "kv_transfer_params.tp_size"),
])
def test_malformed_params_name_the_key(raw, names):
    with pytest.raises(ValueError, match=names.replace(".", r"\.")):
        parse_kv_transfer_params(raw)


def test_kv_transfer_config_parses_vllm_json():
    c = KVTransferConfig(json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cuda",
                                     "kv_connector_extra_config": {"backends": ["UCX"], "transfer_timeout": 5}}))
    assert c.enabled and c.is_producer and c.is_consumer and c.transfer_timeout == 5.0
    assert c.not_applicable == {"kv_buffer_device": "cuda"} and c.engine_id
    assert not KVTransferConfig().enabled


@pytest.mark.parametrize("raw, message", [
    ("{", "not valid JSON"),
    ({"kv_connector": "P2pNcclConnector", "kv_role": "kv_producer"}, "kv_connector must be one of"),
    ({"kv_connector": "NixlConnector", "kv_role": "producer"}, "kv_role must be one of"),
    ({"kv_connector": "NixlConnector", "kv_role": "kv_both", "typo": 1}, r"unknown key\(s\) \['typo'\]"),
    ({"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"transfer_timeout": 0}},
     "transfer_timeout must be a positive number"),
    ({"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"oops": 0}},
     "kv_connector_extra_config: unknown key"),
    ({"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_load_failure_policy": "retry"},
     "kv_load_failure_policy"),
])
def test_bad_kv_transfer_config(raw, message):
    with pytest.raises(ValueError, match=message):
        KVTransferConfig(raw if isinstance(raw, str) else json.dumps(raw))


def test_kv_transfer_refuses_what_it_cannot_do_yet():
    kv = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_consumer"})
    with pytest.raises(ValueError, match="speculative"):
        EngineConfig.from_kwargs(kv_transfer_config=kv,
                                 speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    with pytest.raises(ValueError, match="data_parallel_size 1"):
        EngineConfig.from_kwargs(kv_transfer_config=kv, data_parallel_size=2)


def test_side_channel_env(monkeypatch):
    from m3serve import envs
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "x")
    with pytest.raises(ValueError, match="VLLM_NIXL_SIDE_CHANNEL_PORT"):
        envs.nixl_side_channel()
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600")
    monkeypatch.setenv("VLLM_NIXL_ABORT_REQUEST_TIMEOUT", "-1")
    with pytest.raises(ValueError, match="VLLM_NIXL_ABORT_REQUEST_TIMEOUT"):
        envs.nixl_side_channel()
