"""/metrics under m3serve:* names, vLLM's vllm:* names, or both."""
from m3serve.serving.metrics import ServerMetrics


def test_metric_name_sets():
    m = ServerMetrics("tiny")
    m.generation_tokens.inc(3)
    both = m.render("both").decode()
    only_ours, only_vllm = m.render("m3serve").decode(), m.render("vllm").decode()
    assert 'm3serve:generation_tokens_total{model_name="tiny"} 3.0' in only_ours and "vllm:" not in only_ours
    assert 'vllm:generation_tokens_total{model_name="tiny"} 3.0' in only_vllm and "m3serve:" not in only_vllm
    assert "# TYPE vllm:time_to_first_token_seconds histogram" in only_vllm
    assert both == only_ours + only_vllm
