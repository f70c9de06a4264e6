//! `dramesh`: device-aware multi-cluster estimation for Kubernetes DRA.
//!
//! Exit codes: 0 when the inputs were valid (whatever the answer), 2 when an input cannot be
//! read or is not valid, 1 for any other failure.

mod allocate;
mod plan;
mod table;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

#[derive(Parser)]
#[command(
    name = "dramesh",
    version,
    about = "Device-aware estimation, placement and preemption for multi-cluster Kubernetes DRA"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, Debug, Default, ValueEnum)]
pub enum Output {
    #[default]
    Table,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Allocate the claims of one pod on one node, exactly as kube-scheduler would.
    ///
    /// Inputs: DeviceClass, ResourceSlice, Node, DeviceTaintRule and ResourceClaim manifests.
    /// A ResourceClaim with status.allocation is an existing allocation; every other
    /// ResourceClaim belongs to the pod being allocated, in input order.
    Allocate {
        /// Node to allocate on.
        #[arg(long)]
        node: String,
        /// Manifest file or directory (YAML, multi-document, kind: List, or JSON). Repeatable.
        #[arg(short = 'f', long = "filename", required = true)]
        files: Vec<PathBuf>,
        /// Kubernetes minor version whose allocator semantics to use.
        #[arg(long, default_value = "1.36", value_parser = ["1.34", "1.35", "1.36"])]
        kubernetes_version: String,
        #[arg(short, long, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
    /// Max replicas of a workload per member cluster (Karmada MaxAvailableReplicas, device-aware).
    ///
    /// SNAPSHOT holds one folder per member cluster (folder name = cluster name) with YAML of
    /// Nodes, Pods, ResourceSlices, DeviceClasses, ResourceClaims and an optional cluster.yaml.
    Estimate {
        #[arg(long)]
        snapshot: PathBuf,
        /// Deployment, StatefulSet, Job or Pod, plus the ResourceClaimTemplates it references.
        #[arg(short = 'w', long, required = true)]
        workload: Vec<PathBuf>,
        #[arg(short, long, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
    /// Spread a workload's replicas over member clusters by a Karmada PropagationPolicy.
    Place {
        #[arg(long)]
        snapshot: PathBuf,
        #[arg(short = 'w', long, required = true)]
        workload: Vec<PathBuf>,
        /// PropagationPolicy or ClusterPropagationPolicy YAML (default: one beside the workload).
        #[arg(long)]
        policy: Option<PathBuf>,
        #[arg(short, long, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
    /// Choose lower-priority workloads to evict so a workload fits (device-aware).
    Preempt {
        #[arg(long)]
        snapshot: PathBuf,
        #[arg(short = 'w', long, required = true)]
        workload: Vec<PathBuf>,
        /// Restrict the candidate clusters to a policy's cluster affinity.
        #[arg(long)]
        policy: Option<PathBuf>,
        #[arg(short, long, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
}

/// An error with its exit code: 2 for bad input, 1 otherwise.
pub struct Failure {
    pub code: u8,
    pub message: String,
}

impl Failure {
    pub fn input(message: impl std::fmt::Display) -> Failure {
        Failure {
            code: 2,
            message: message.to_string(),
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Allocate {
            node,
            files,
            kubernetes_version,
            output,
        } => allocate::run(&node, &files, &kubernetes_version, output),
        Command::Estimate {
            snapshot,
            workload,
            output,
        } => plan::run_estimate(&snapshot, &workload, output),
        Command::Place {
            snapshot,
            workload,
            policy,
            output,
        } => plan::run_place(&snapshot, &workload, policy.as_deref(), output),
        Command::Preempt {
            snapshot,
            workload,
            policy,
            output,
        } => plan::run_preempt(&snapshot, &workload, policy.as_deref(), output),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            eprintln!("dramesh: {}", f.message);
            ExitCode::from(f.code)
        }
    }
}
