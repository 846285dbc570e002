"""The coordinator (chief) side: strategy, sharded variables, closures, clusters.

    from coordinator import LocalCluster, ParameterServerStrategy, ClusterCoordinator
"""
from coordinator.callbacks import (
                                Callback,
                                CheckpointCallback,
                                EarlyStopping,
                                History,
                                LambdaCallback,
                                PlotHistory,
                                TensorBoard,
                                TerminateOnNaN,
)
from coordinator.checkpoint import CheckpointManager
from coordinator.cluster_spec import (
                                ClusterConfigError,
                                ClusterSpec,
                                TFConfigClusterResolver,
)
from coordinator.compression import BF16, FP16, TopK
from coordinator.coordinator import ClusterCoordinator, RemoteValue, RemoteValueStatus
from coordinator.datasets import InputContext, batches
from coordinator.docker_cluster import DockerCluster
from coordinator.embedding import DynamicEmbedding, TableStats
from coordinator.embedding_collection import Bags, EmbeddingCollection, EmbeddingConfig
from coordinator.errors import (
                                ClosureCancelled,
                                CoordinatorError,
                                ParameterServerLost,
                                StepFunctionError,
                                WorkerCallError,
)
from coordinator.fit import FitState, fit
from coordinator.local import LocalCluster
from coordinator.partitioners import (
                                FixedShardsPartitioner,
                                MaxSizePartitioner,
                                MinSizePartitioner,
)
from coordinator.plots import plot_history
from coordinator.progress import Progress
from coordinator.replica import ReplicaContext, get_replica_context
from coordinator.sharded import DataStats, ShardedDataset, ShardedSource
from coordinator.step_calls import IndexedSlices, Lookup, push_gradients, read_variables
from coordinator.strategy import ParameterServerStrategy
from coordinator.variables import ShardedVariable
from psserver.contract import Initializer

__all__ = [
    "ClusterConfigError", "ClusterSpec", "TFConfigClusterResolver", "ClosureCancelled",
    "ClusterCoordinator", "CoordinatorError", "RemoteValue", "RemoteValueStatus",
    "StepFunctionError", "WorkerCallError", "ParameterServerLost", "InputContext", "batches",
    "ShardedSource", "ShardedDataset", "DataStats", "LocalCluster",
    "DockerCluster",
    "FixedShardsPartitioner", "MaxSizePartitioner", "MinSizePartitioner",
    "ParameterServerStrategy", "ShardedVariable", "push_gradients", "read_variables",
    "IndexedSlices", "Lookup", "DynamicEmbedding", "TableStats", "EmbeddingCollection",
    "EmbeddingConfig", "Bags",
    "Initializer", "CheckpointManager", "FitState", "fit", "Callback", "CheckpointCallback",
    "EarlyStopping", "History", "LambdaCallback", "PlotHistory", "TensorBoard",
    "TerminateOnNaN", "Progress", "plot_history", "ReplicaContext", "get_replica_context",
    "FP16", "BF16", "TopK",
]
