import json, httpx
from tests.data_plane.test_completions_api import gateway, MODEL  # noqa
from tests.support.cluster import KEYS
H = {"Authorization": f"Bearer {KEYS['plus']}"}

def test_peek(gateway):
    u = gateway.url + "/v1/completions"
    bodies = [{"prompt": [[]]}, {"prompt": [-1]}, {"prompt": [2**40]}, {"prompt": ["a", ""]}, {"prompt": [1.5]},
              {"prompt": True}, {"prompt": None}, {"prompt": {"a": 1}}, {"prompt": "x", "stop": ["a","b","c","d","e"]},
              {"prompt": "x", "max_tokens": "16"}, {"prompt": "x", "n": 0}, {"prompt": "x", "best_of": 0},
              {"prompt": "x", "echo": None, "stream": None, "temperature": None, "max_tokens": 2},
              {"prompt": "x", "logit_bias": {"99999999": 5}, "max_tokens": 2},
              {"prompt": "x", "top_k": 5, "max_tokens": 2, "logprobs": 5, "n": 3},
              {"prompt": ["x"] * 33}, {"prompt": ["x"] * 9, "n": 8},
              {"prompt": "x", "seed": 3, "temperature": 1.0, "max_tokens": 3, "n": 2},
              {"prompt": "x" * 20000, "max_tokens": 2},
              {"prompt": "word " * 1900, "max_tokens": 200},
              {"prompt": "x", "stream_options": {"include_usage": True}, "stream": False},
              {"prompt": "x", "max_tokens": 2, "session_id": "abc"},
              {"prompt": "x", "max_tokens": 2, "suffix": ""},
              {"prompt": "x", "max_tokens": 2, "suffix": None, "best_of": 1},
              ]
    for body in bodies:
        r = httpx.post(u, headers=H, json={"model": MODEL, **body}, timeout=120)
        print(r.status_code, json.dumps(r.json())[:300])
    r = httpx.post(u, headers=H, content=b'{"prompt": "\\ud800"}', timeout=60); print(r.status_code, r.text[:300])
    r = httpx.post(u, headers={**H, "X-Session-Id": "new"}, json={"prompt": "x", "max_tokens": 2}, timeout=60); print(r.status_code, r.headers.get("x-session-id"), r.text[:200])
    r = httpx.get(gateway.url + "/openapi.json"); print(r.json()["paths"]["/v1/completions"])
