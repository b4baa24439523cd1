"""Run in the serving environment by ``serving.py``: vLLM's offline throughput of each model
folder on the same requests, the folders' engines alive together and timed in turn, round after
round (a warm-up round first). Writes ``{folder: [seconds per round]}`` as JSON.

    python serving_worker.py OUT.json REQUESTS.json ROUNDS KV_CACHE_BYTES FOLDER [FOLDER ...]

``REQUESTS.json``: ``{"prompts": [[token ids], ...], "max_tokens": n}``; every request decodes
``max_tokens`` tokens greedily (``ignore_eos``), so every folder produces as many tokens."""

import json
import sys
import time
from pathlib import Path


def main() -> None:
    from vllm import LLM, SamplingParams

    out, requests, rounds, kv_bytes, folders = (Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text()),
                                                int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:])
    params = SamplingParams(temperature=0, max_tokens=requests["max_tokens"], ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in requests["prompts"]]
    engines = {f: LLM(model=f, enforce_eager=True, dtype="float32", max_model_len=1024, seed=0,
                      kv_cache_memory_bytes=kv_bytes) for f in folders}
    times = {f: [] for f in folders}
    for r in range(rounds + 1):
        for folder, llm in engines.items():
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            if r:  # round 0 warms up
                times[folder].append(time.perf_counter() - start)
    out.write_text(json.dumps(times))


if __name__ == "__main__":
    main()
