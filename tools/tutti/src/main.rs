//! `tutti`: administration of NVMe devices, pools and the cluster registry.
//!
//! One module per subcommand group; each owns its clap arguments and a `run` function taking the
//! [`System`] paths, so a new group (`tutti pool ...`) is a module plus one enum variant here.
//!
//! Exit status (`tutti_cli::exit`): 0 done (for `pool check` and `pool inspect`: nothing damaged), 1 the operation
//! failed or damage was found (a device that holds no pool included: never formatted and a
//! destroyed superblock look alike), 2 unusable input (a bad flag, device string, PCI address or
//! model geometry; a file that is empty or too small; a pool of another geometry or format
//! version; a device or PCI function that is not there, not an NVMe controller, bound to a driver
//! other than vfio-pci (unbind) or in use), 141 standard output closed.
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tutti_cli::exit;

mod cluster;
mod devices;
mod pool;
mod system;

use system::System;

/// tutti administration tool.
#[derive(Parser)]
#[command(version, about, after_long_help = tutti_cli::exit::help_text(true))]
struct Cli {
    /// Where sysfs is mounted (tests point this at a fake tree).
    #[arg(long, global = true, hide = true, default_value = "/sys")]
    sysfs_root: PathBuf,
    /// Where procfs is mounted (for /proc/mounts and /proc/swaps).
    #[arg(long, global = true, hide = true, default_value = "/proc")]
    proc_root: PathBuf,
    /// Where the block device nodes are (opened with O_EXCL to see whether a disk is in use).
    #[arg(long, global = true, hide = true, default_value = "/dev")]
    dev_root: PathBuf,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List NVMe functions (PCI class 0x010802): model, driver, IOMMU group, VFIO readiness.
    Devices(devices::DevicesArgs),
    /// Move an NVMe function to vfio-pci so tutti can drive it from user space.
    Bind(devices::BindArgs),
    /// Give an NVMe function back to the kernel (its default driver, normally nvme).
    Unbind(devices::UnbindArgs),
    /// Format, inspect or check an object-store pool on NVMe namespaces.
    #[command(subcommand)]
    Pool(pool::PoolCommand),
    /// The cluster tier in etcd: members, leases, segments per node, replica counts.
    #[command(subcommand)]
    Cluster(cluster::ClusterCommand),
}

/// Input the command cannot use: one line, exit status 2.
pub use tutti_cli::exit::Unusable;

fn main() -> ExitCode {
    tutti_cli::init_stderr_logging();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(error) => return ExitCode::from(exit::report_parse_error(&error)),
    };
    let system = System::new(cli.sysfs_root, cli.proc_root, cli.dev_root);
    let result = match cli.command {
        Command::Devices(args) => devices::run_devices(&system, &args),
        Command::Bind(args) => devices::run_bind(&system, &args),
        Command::Unbind(args) => devices::run_unbind(&system, &args),
        Command::Pool(command) => pool::run(&command),
        Command::Cluster(command) => cluster::run(&command),
    }
    .and_then(|()| Ok(tutti_cli::stdout::flush()?));
    exit::status_of("tutti", result)
}
