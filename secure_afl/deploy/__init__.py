"""Deployment among institutions over Flower's deployment runtime (SuperLink and SuperNodes).

What each party runs:

- the server: the ServerApp (:mod:`secure_afl.deploy.apps`), which drives
  :class:`~secure_afl.deploy.server.FederationServer`: protocol sessions over the study's
  :class:`~secure_afl.aggregation.backend.ProtectionBackend` (pairwise masking or CKKS, the same
  backends the simulator drives), the closed-form solve, the classifier file;
- each hospital: a SuperNode whose ClientApp (:mod:`secure_afl.deploy.apps`) hands every server
  message to :func:`secure_afl.deploy.client.handle`, which reads the hospital's feature file
  (:mod:`secure_afl.features.file`), identity key and pinned roster, and answers;
- ``secure-afl deploy local`` (:mod:`secure_afl.deploy.local`) brings a whole federation up on one
  machine.

Protocol messages travel as opaque bytes in Flower records (:mod:`secure_afl.deploy.wire`).  Flower's
node ids only route messages: clients are identified by their roster signatures.  This package never
imports :mod:`secure_afl.sim`.
"""
