"""What a hospital runs on its own images before any aggregation: client-side feature extraction.

- :mod:`secure_afl.features.backbones`: the frozen backbones and their preprocessing (SPEC §4).
- :mod:`secure_afl.features.images`: reading and checking the X-ray files.
- :mod:`secure_afl.features.extraction`: the cached, resumable extraction of features from images.

Both the simulator (:mod:`secure_afl.sim`) and the deployment (:mod:`secure_afl.deploy`) import this
package; neither imports the other.  Importing the package itself loads nothing heavy (no torch).
"""
