"""Run in the serving environment: one completion request to ``attnres serve`` at ``PORT``
through the ``openai`` client, greedy, its tokens (as ids) written as JSON to ``OUT``.

    python openai_client.py PORT MODEL_DIR OUT.json"""

import json
import sys
from pathlib import Path

from openai import OpenAI


def main() -> None:
    port, model_dir, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    spec = json.loads((Path(model_dir) / "reference.json").read_text())
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
    response = client.completions.create(
        model=model_dir, prompt=[spec["prompts"][0]], max_tokens=spec["max_tokens"], temperature=0, logprobs=0,
        extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    tokens = [int(t.removeprefix("token_id:")) for t in response.choices[0].logprobs.tokens]
    out.write_text(json.dumps(tokens))


if __name__ == "__main__":
    main()
