"""The routing backends: one module each, all with the same functions and signatures.

Every backend module offers::

    attend(queries, sources, gains=None, *, heads, eps, score, key_norm, norm=None, prepared=None)
        -> (outs, lse)
    merge(o1, lse, partial, query, gain=None, *, heads, eps, score, key_norm, norm=None) -> h
    prepare(source, *, eps, key_norm) -> a per-source value for ``prepared``, or None

``attend``: ``S`` queries ``[S, D]`` (key-norm gains ``[S, D]`` or None) against a list of sources
``N x [..., D]`` (never stacked by the caller); one output ``[..., D]`` per query in the sources'
dtype and the log-sum-exp of each query's logits ``[S, ..., H]`` (zeros for the sigmoid score).
``merge``: phase 2 of the two-phase Block computation (docs/METHOD.md section 3), the partial source
``[..., D]`` folded into one phase-1 result. ``norm``, anything with ``weight`` (``[D]`` or None)
and ``eps`` (an ``ops.RMSNorm``), returns the first output (``merge``: the result) through the
read's pre-norm, ``rms_norm(x, norm.weight, norm.eps)``, fused where the backend can.
``prepared``: each source's ``prepare`` value (entries may be None), so that a source read by
many sublayers is prepared once. ``prepare`` returns None or a tensor of one value per token
``[...]`` (a source shared by every token is prepared once and the value expanded with it).

A backend whose registry line says ``scores_ahead`` also offers, for inference::

    score_source(source, queries, gains=None, *, heads, eps, key_norm, prepared=None) -> [..., K, H]
    attend_scored(scores, sources, *, score, norm=None) -> (outs, lse)

A backend whose registry line says ``decodes`` also offers, for a decode pass (autograd off, one
position per sequence), whose sources the stream keeps one after another in one buffer::

    decode_read(sources, count, query, *, heads, eps, score, key_norm, base=None, gate=0.0, norm=None) -> out

A backend whose registry line says ``defers_source_grads`` leaves, in ``attend``'s backward, the
gradients of sources an ``ops.source_ledger`` tracks to the ledger, and offers what forms them::

    source_grad(source, inv_rms, reads, grad=None, *, heads, eps, score, key_norm) -> [..., D]

What each backend accepts (devices, dtypes, ablations) is declared in ``ops.registry``.
"""
