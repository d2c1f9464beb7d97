"""`hybridmoe cluster`: N `hybridmoe serve` replicas behind one OpenAI endpoint, the SGLang
model gateway (sglang-router, the optional extra `hybridmoe[cluster]`), with prefix-aware
routing; docs/proposals/0005-replicas.md says why that engine."""
