//! The slurm spawner: inside `salloc`/`sbatch`, `softnic run --config FILE -n N -- PROGRAM`
//! runs `srun` twice — once per node (`--ntasks-per-node=1`) to make sure a softnicd serves
//! the node (`softnic daemon-up`, which starts one detached where none answers), then
//! `srun --mpi=pmi2 -n N PROGRAM`, whose ranks bootstrap through Slurm's PMI and find their
//! daemon from `SOFTNIC_CONFIG` and the node's name (a config host named as the Slurm node,
//! `SLURMD_NODENAME`, or the config's host whose address is on the node). Failures, Ctrl-C
//! and cleanup are srun's, as users of Slurm expect.

use std::process::Command;

use super::local::{Launch, LaunchError};

/// Runs the job through srun; returns srun's exit code.
pub fn run(l: &Launch) -> Result<i32, LaunchError> {
    let config = l.config.clone().ok_or(LaunchError::NeedConfig("slurm"))?;
    let config = std::fs::canonicalize(&config).unwrap_or(config);
    let nodes = std::env::var("SLURM_JOB_NUM_NODES")
        .or_else(|_| std::env::var("SLURM_NNODES"))
        .map_err(|_| {
            LaunchError::Daemon(
                "the slurm spawner runs inside an allocation (salloc, sbatch): no \
                 SLURM_JOB_NUM_NODES here"
                    .into(),
            )
        })?;
    let softnic = super::softnic_binary()?;
    let srun = |c: &mut Command| -> Result<i32, LaunchError> {
        let st = c.status().map_err(|source| LaunchError::Spawn {
            rank: 0,
            program: "srun".into(),
            source,
        })?;
        Ok(super::supervise::describe(st).1)
    };
    // One daemon per node, where none runs yet.
    let code = srun(
        Command::new("srun")
            .args(["--nodes", &nodes, "--ntasks", &nodes, "--ntasks-per-node=1"])
            .arg(&softnic)
            .args(["daemon-up", "--config"])
            .arg(&config),
    )?;
    if code != 0 {
        return Err(LaunchError::Daemon(format!(
            "srun of the daemons exited with {code}"
        )));
    }
    let mut c = Command::new("srun");
    c.args(["--mpi=pmi2", "-n", &l.ranks.to_string()]);
    if let Some(p) = l.ppn {
        c.arg(format!("--ntasks-per-node={p}"));
    }
    if l.map == super::placement::Map::Cyclic {
        c.arg("--distribution=cyclic");
    }
    if l.label {
        c.arg("--label");
    }
    c.arg(&l.program)
        .args(&l.args)
        .env("SOFTNIC_CONFIG", &config);
    if let Some(conduit) = &l.conduit {
        c.env("SOFTNIC_CONDUIT", conduit);
    }
    c.envs(l.env.iter().map(|(k, v)| (k, v)));
    srun(&mut c)
}
