"""Run in the serving environment (``.venv-serve``): vLLM's greedy tokens for each model folder
named on the command line, written as JSON to the file named first.

    python vllm_worker.py OUT.json FOLDER [FOLDER ...]

Each folder holds ``reference.json`` (``prompts``: token lists, ``max_tokens``); for each folder
the output holds ``batch`` (every prompt in one ``generate``: vLLM batches them continuously,
flat) and ``alone`` (each prompt in a ``generate`` of its own). One engine per folder, in turn."""

import gc
import json
import sys
from pathlib import Path


def main() -> None:
    from vllm import LLM, SamplingParams

    out, folders = Path(sys.argv[1]), sys.argv[2:]
    results = {}
    for folder in folders:
        spec = json.loads((Path(folder) / "reference.json").read_text())
        llm = LLM(model=folder, enforce_eager=True, dtype="float32", max_model_len=256, seed=0,
                  kv_cache_memory_bytes=1 << 28)
        params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True)

        def tokens(prompts):
            return [list(o.outputs[0].token_ids) for o in llm.generate(
                [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]

        results[folder] = {"batch": tokens(spec["prompts"]), "alone": [tokens([p])[0] for p in spec["prompts"]]}
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    out.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
