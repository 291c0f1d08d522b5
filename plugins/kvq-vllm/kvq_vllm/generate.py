"""Run one vLLM engine (stock or with a kvq codec) on a few prompts and report in JSON.

One engine per process: vLLM caches its backend choice per process, and the tests and the
benchmark compare engines, so each runs as ``python -m kvq_vllm.generate '<json job>'``,
which prints one line ``KVQ_RESULT {...}``. :class:`Job` starts that process (several may run
at once: loading is mostly single-threaded imports), :func:`run_job` starts one and waits.

A job: ``{"model": dir, "kvq": {...} or null, "prompts": [...] (texts, or lists of token ids),
"max_tokens": 16, "engine": {extra LLM kwargs}, "repeat": [prompt indices to run again alone,
after the batch], "track_running": false}``. With ``track_running`` the engine core runs in this
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and every scheduler step's running requests are
counted, for ``peak_running``.
The result: per batch output ``text``, ``token_ids``, ``prompt_tokens``, ``num_cached_tokens``;
the KV capacity vLLM reports (``kv_blocks``, ``block_size``, ``kv_tokens``); ``kv_bytes_per_token``
(all layers); ``seconds`` of the batch and ``tokens_per_s`` (generated tokens over that wall time,
prefill included); ``preemptions``; ``peak_running`` (most requests running in one step, with
``track_running``); ``backend`` (the attention backend class in use); ``error`` (the exception's
type and text when the engine failed to start, e.g. kvq refusing a setting: then nothing else).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

MARK = "KVQ_RESULT "
ENGINE_DEFAULTS = {"dtype": "float32", "enforce_eager": True, "max_model_len": 512, "max_num_seqs": 8,
                   "disable_log_stats": False}


def _metric(llm: Any, name: str) -> float:
    total = 0.0
    for m in llm.get_metrics():
        if m.name == name and hasattr(m, "value"):
            total += float(m.value)
    return total


#: the warm-up request (``job["warmup"]``): 64 token ids no benchmark prompt starts with (so the
#: prefix cache shares nothing with the timed run), long enough for a multi-token prefill path
WARMUP_PROMPT = list(range(1000, 1064))


def main(job: dict[str, Any]) -> dict[str, Any]:
    # _engine_facts is sent to the worker by collective_rpc, which pickles functions only when allowed.
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from vllm import LLM, SamplingParams

    engine = {**ENGINE_DEFAULTS, **job.get("engine", {})}
    if job.get("kvq") is not None:
        engine["additional_config"] = {"kvq": job["kvq"]}
    t0 = time.perf_counter()
    try:
        llm = LLM(model=job["model"], **engine)
    except Exception as exc:  # the engine refused to start: report why (the tests check the reason)
        return {"error": f"{type(exc).__name__}: {exc}"}
    load = time.perf_counter() - t0
    config = llm.llm_engine.vllm_config
    running = _track_running(llm) if job.get("track_running") else []
    params = SamplingParams(temperature=0.0, max_tokens=job.get("max_tokens", 16), ignore_eos=True)
    prompts = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in job["prompts"]]
    if job.get("warmup"):  # compile every kernel a step runs (prefill and decode) before the clock starts
        llm.generate([{"prompt_token_ids": WARMUP_PROMPT}], SamplingParams(temperature=0.0, max_tokens=4),
                     use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    peak = max(running, default=0)
    repeats = [llm.generate([prompts[i]], params, use_tqdm=False)[0] for i in job.get("repeat", [])]
    info = llm.collective_rpc(_engine_facts)[0]
    cache = config.cache_config
    return {
        "outputs": [_output(o) for o in outs],
        "repeats": [_output(o) for o in repeats],
        "kv_blocks": cache.num_gpu_blocks,
        "block_size": cache.block_size,
        "kv_tokens": cache.num_gpu_blocks * cache.block_size,
        "kv_bytes_per_token": info["bytes_per_token"],
        "backend": info["backend"],
        "load_seconds": round(load, 1),
        "seconds": round(seconds, 2),
        "tokens_per_s": round(generated / seconds, 2),
        "preemptions": _metric(llm, "vllm:num_preemptions"),
        "peak_running": peak,
        "draft_tokens": _metric(llm, "vllm:spec_decode_num_draft_tokens"),
        "accepted_tokens": _metric(llm, "vllm:spec_decode_num_accepted_tokens"),
    }


def _track_running(llm: Any) -> list[int]:
    """Count the scheduler's running requests at every step (the engine core runs in this process)."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    counts: list[int] = []
    schedule = scheduler.schedule

    def counted(*args: Any, **kwargs: Any) -> Any:
        out = schedule(*args, **kwargs)
        counts.append(len(scheduler.running))
        return out

    scheduler.schedule = counted
    return counts


def _output(o: Any) -> dict[str, Any]:
    return {"text": o.outputs[0].text, "token_ids": list(o.outputs[0].token_ids), "prompt_tokens": len(o.prompt_token_ids),
            "num_cached_tokens": o.num_cached_tokens or 0}


def _engine_facts(worker: Any) -> dict[str, Any]:
    """Inside the worker: the attention backend in use and the KV bytes per token over all layers."""
    runner = worker.model_runner
    layers = runner.vllm_config.compilation_config.static_forward_context
    attn = [m for m in layers.values() if hasattr(m, "get_attn_backend")]
    backend = attn[0].get_attn_backend()
    specs = runner.get_kv_cache_spec()
    per_token = sum(s.page_size_bytes // s.block_size for s in specs.values())
    return {"backend": f"{backend.__module__}.{backend.__qualname__}", "bytes_per_token": per_token}


class Job:
    """One engine job running in a fresh interpreter (this one's); several may run at once."""

    def __init__(self, job: dict[str, Any], *, env: dict[str, str] | None = None) -> None:
        base = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), **(env or {})}
        if job.get("track_running"):
            base["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # Files, not pipes: a job blocked on a full pipe would wait for the jobs read before it.
        self.out, self.err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "kvq_vllm.generate", json.dumps(job)],
                                     stdout=self.out, stderr=self.err, text=True, env=base)

    def result(self, timeout: float = 900) -> dict[str, Any]:
        """The job's result; raises with the end of its log when it failed."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        out, err = (self._read(f) for f in (self.out, self.err))
        for line in out.splitlines():
            if line.startswith(MARK):
                result = json.loads(line[len(MARK):])
                if "error" in result:  # the engine's log says why: vLLM's workers log their exception on
                    result["log"] = f"{out[-40000:]}\n{err[-40000:]}"  # stdout, the engine core's on stderr
                return result
        raise RuntimeError(f"vLLM job failed (exit {self.proc.returncode}):\n{out[-3000:]}\n{err[-6000:]}")

    @staticmethod
    def _read(f: Any) -> str:
        f.seek(0)
        return f.read()


def run_job(job: dict[str, Any], *, timeout: float = 900, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``job`` in a fresh interpreter and return its result."""
    return Job(job, env=env).result(timeout)


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]))
    print(MARK + json.dumps(result), flush=True)
