//! `tutti`: administration of NVMe devices and pools.
//!
//! One module per subcommand group; each owns its clap arguments and a `run` function taking the
//! [`System`] paths, so a new group (`tutti pool ...`) is a module plus one enum variant here.
use std::path::PathBuf;

use clap::{Parser, Subcommand};

mod devices;
mod pool;
mod system;

use system::System;

/// tutti administration tool.
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    /// Where sysfs is mounted (tests point this at a fake tree).
    #[arg(long, global = true, hide = true, default_value = "/sys")]
    sysfs_root: PathBuf,
    /// Where procfs is mounted (for /proc/mounts and /proc/swaps).
    #[arg(long, global = true, hide = true, default_value = "/proc")]
    proc_root: PathBuf,
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
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let system = System::new(cli.sysfs_root, cli.proc_root);
    match cli.command {
        Command::Devices(args) => devices::run_devices(&system, &args),
        Command::Bind(args) => devices::run_bind(&system, &args),
        Command::Unbind(args) => devices::run_unbind(&system, &args),
        Command::Pool(command) => pool::run(&command),
    }
}
