"""Checkpoint bundles on disk: the manifest, crash-safe writes, validity, latest, retention, resume.

A save path is a directory holding one subdirectory per bundle (``r00000042-epoch``). A bundle
holds the consensus model (``consensus.pt``), the outer optimizer's state (``outer.pt``), each
rank's optimizer and RNG state (``rank{r}.pt``, written on the rank's own host) and
``manifest.json``, written last: the commit record, with a SHA-256 per file. A bundle is valid
iff its manifest parses and every listed file's hash matches. The controller and the ranks
decide *when* to write (``training``, ``controller``, ``trainer``); this package only writes,
checks and finds bundles. No asyncio and no socket: file I/O only, torch imported inside the
functions that save and load tensors.

Pure: nothing here imports asyncio or socket.
May import: errors, wire, training.
"""

from .bundle import (
    MANIFEST_FILE,
    OUTER_FILE,
    BundleWriter,
    Skipped,
    find_latest,
    list_bundles,
    retain,
    verify_bundle,
)
from .manifest import (
    CONSENSUS_FILE,
    SCHEMA_VERSION,
    DataParams,
    JsonValue,
    Manifest,
    Reason,
    bundle_name,
    coverage_of,
    covered_batches,
    elche_from_json,
    elche_to_json,
    parse_bundle_name,
)
from .resume import check_resume
from .state import (
    RankState,
    RngState,
    capture_rng,
    load_consensus,
    load_outer,
    load_rank_state,
    rank_file,
    restore_rng,
    save_consensus,
    save_outer,
    save_rank_state,
)

__all__ = [
    "CONSENSUS_FILE",
    "MANIFEST_FILE",
    "OUTER_FILE",
    "SCHEMA_VERSION",
    "BundleWriter",
    "DataParams",
    "JsonValue",
    "Manifest",
    "RankState",
    "Reason",
    "RngState",
    "Skipped",
    "bundle_name",
    "capture_rng",
    "check_resume",
    "coverage_of",
    "covered_batches",
    "elche_from_json",
    "elche_to_json",
    "find_latest",
    "list_bundles",
    "load_consensus",
    "load_outer",
    "load_rank_state",
    "parse_bundle_name",
    "rank_file",
    "restore_rng",
    "retain",
    "save_consensus",
    "save_outer",
    "save_rank_state",
    "verify_bundle",
]
