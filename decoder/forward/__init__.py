"""How the loop runs the target model: a KV cache written in place (`_kv.py`), linear weights packed once
(`_packed.py`), grouped-query attention read in place (`_attention.py`), the causal mask built once (`_mask.py`),
and the name transformers gives the cache argument (`_compat.py`). Private to `decoder`."""
