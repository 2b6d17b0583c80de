//! Where ranks go: `--map block` (fill a host, then the next; `--ppn` ranks each, or as evenly
//! as the ranks allow) or `--map cyclic` (one per host in turn), over the job's hosts.

/// How ranks are laid out over hosts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Map {
    /// Consecutive ranks on one host (`--ppn` of them, or ⌈N/hosts⌉).
    Block,
    /// Rank r on host r mod hosts (the local default's layout).
    #[default]
    Cyclic,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PlacementError {
    #[error("no hosts to place ranks on")]
    NoHosts,
    #[error("{ranks} ranks do not fit {hosts} host(s) at --ppn {ppn}")]
    TooMany { ranks: u32, hosts: usize, ppn: u32 },
    #[error("--ppn must be at least 1")]
    ZeroPpn,
}

/// The host of every rank: entries of `hosts` (config host indices) laid out by `map`, with at
/// most `ppn` ranks per host when given.
pub fn place(
    ranks: u32,
    hosts: &[u16],
    ppn: Option<u32>,
    map: Map,
) -> Result<Vec<u16>, PlacementError> {
    let nh = hosts.len();
    if nh == 0 {
        return Err(PlacementError::NoHosts);
    }
    if ppn == Some(0) {
        return Err(PlacementError::ZeroPpn);
    }
    if let Some(p) = ppn {
        if ranks as u64 > p as u64 * nh as u64 {
            return Err(PlacementError::TooMany {
                ranks,
                hosts: nh,
                ppn: p,
            });
        }
    }
    Ok((0..ranks)
        .map(|r| match map {
            Map::Cyclic => hosts[r as usize % nh],
            Map::Block => {
                let per = ppn.unwrap_or_else(|| ranks.div_ceil(nh as u32)).max(1);
                hosts[(r / per) as usize]
            }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_and_cyclic() {
        let h = [0, 1, 2];
        assert_eq!(place(6, &h, None, Map::Cyclic), Ok(vec![0, 1, 2, 0, 1, 2]));
        assert_eq!(place(6, &h, None, Map::Block), Ok(vec![0, 0, 1, 1, 2, 2]));
        assert_eq!(place(5, &h, None, Map::Block), Ok(vec![0, 0, 1, 1, 2]));
        assert_eq!(place(4, &h, Some(3), Map::Block), Ok(vec![0, 0, 0, 1]));
        assert_eq!(
            place(4, &[5, 7], Some(2), Map::Cyclic),
            Ok(vec![5, 7, 5, 7])
        );
        assert_eq!(
            place(7, &h, Some(2), Map::Block),
            Err(PlacementError::TooMany {
                ranks: 7,
                hosts: 3,
                ppn: 2
            })
        );
        assert_eq!(
            place(1, &[], None, Map::Block),
            Err(PlacementError::NoHosts)
        );
        assert_eq!(
            place(1, &h, Some(0), Map::Block),
            Err(PlacementError::ZeroPpn)
        );
    }
}
