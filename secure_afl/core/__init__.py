"""The floor below ``protocol/`` and ``privacy/``: the errors both raise, the fixed-point encoding of
statistics onto Z_{2^64}, and the injected randomness sources.  Imports nothing else of secure_afl."""
