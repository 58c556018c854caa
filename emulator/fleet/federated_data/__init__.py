"""Federated datasets from local files: client id -> examples, in the formats the field uses.

``FederatedDataset`` is the value (train and test clients, one feature schema, sorted client ids);
the loaders read LEAF's JSON (``load_leaf``), TFF's ClientData HDF5 (``load_tff_h5``), tables with a
client column (``load_table``: Parquet, CSV, ``datasets.save_to_disk``), and ``partition_arrays``
cuts a centralized dataset with the seeded partitioners of ``partition`` (flwr-datasets' names).
``load_data("FORMAT:PATH,...")`` reads what a data spec names; ``client_accuracy_percentiles`` gives
the per-client accuracy percentiles LEAF and FedScale report. Nothing here downloads: every loader
reads local files only, and h5py, pyarrow and ``datasets`` (the ``data`` extra) are imported only
by the loader that needs them.
"""

from ._dataset import FeatureSpec, FederatedDataset, split_clients, split_examples, with_test_split
from ._errors import DataLayoutError, DataSpecError, FederatedDataError, MissingDependencyError, PartitionError
from .evaluation import ClientAccuracy, client_accuracy_percentiles
from .leaf import load_leaf
from .partition import Partitioner, dirichlet, iid, partition_arrays, pathological, quantity_skew, shards
from .spec import DataSpec, load_data, parse_data_spec
from .table import load_table
from .text import LEAF_CHARACTERS, CharWindows, WordIds, build_vocabulary, encode_characters, encode_words, split_words
from .tff_h5 import load_tff_h5

__all__ = [
    "CharWindows",
    "ClientAccuracy",
    "DataLayoutError",
    "DataSpec",
    "DataSpecError",
    "FeatureSpec",
    "FederatedDataError",
    "FederatedDataset",
    "LEAF_CHARACTERS",
    "MissingDependencyError",
    "PartitionError",
    "Partitioner",
    "WordIds",
    "build_vocabulary",
    "client_accuracy_percentiles",
    "dirichlet",
    "encode_characters",
    "encode_words",
    "iid",
    "load_data",
    "load_leaf",
    "load_table",
    "load_tff_h5",
    "parse_data_spec",
    "partition_arrays",
    "pathological",
    "quantity_skew",
    "shards",
    "split_clients",
    "split_examples",
    "split_words",
    "with_test_split",
]
