//! Pod address allocation: the next free host address of each pool, as a CNI's IPAM would.

use std::collections::BTreeSet;
use std::net::{Ipv4Addr, Ipv6Addr};

use ipnet::{Ipv4Net, Ipv6Net};

use super::LabError;

pub const DEFAULT_IPV4_POOL: &str = "10.244.0.0/16";
pub const DEFAULT_IPV6_POOL: &str = "fd00:10:244::/64";

/// The lowest address of `pool` above its network address that is not in `used`.
pub fn next_ipv4(pool: Ipv4Net, used: &BTreeSet<Ipv4Addr>) -> Result<Ipv4Addr, LabError> {
    pool.hosts()
        .skip(1) // .1 is conventionally the gateway
        .find(|ip| !used.contains(ip))
        .ok_or_else(|| LabError::AddressesExhausted(pool.to_string()))
}

pub fn next_ipv6(pool: Ipv6Net, used: &BTreeSet<Ipv6Addr>) -> Result<Ipv6Addr, LabError> {
    pool.hosts()
        .skip(2) // the subnet-router anycast address and ::1
        .find(|ip| !used.contains(ip))
        .ok_or_else(|| LabError::AddressesExhausted(pool.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocates_lowest_free_host_address() {
        let pool: Ipv4Net = DEFAULT_IPV4_POOL.parse().unwrap();
        let mut used = BTreeSet::new();
        let first = next_ipv4(pool, &used).unwrap();
        assert_eq!(first, Ipv4Addr::new(10, 244, 0, 2));
        used.insert(first);
        used.insert(Ipv4Addr::new(10, 244, 0, 4));
        assert_eq!(
            next_ipv4(pool, &used).unwrap(),
            Ipv4Addr::new(10, 244, 0, 3)
        );
        let pool6: Ipv6Net = DEFAULT_IPV6_POOL.parse().unwrap();
        assert_eq!(
            next_ipv6(pool6, &BTreeSet::new()).unwrap(),
            "fd00:10:244::2".parse::<Ipv6Addr>().unwrap()
        );
    }

    #[test]
    fn exhausted_pool_is_an_error() {
        let pool: Ipv4Net = "10.0.0.0/30".parse().unwrap();
        let used = [Ipv4Addr::new(10, 0, 0, 2)].into_iter().collect();
        assert!(matches!(
            next_ipv4(pool, &used),
            Err(LabError::AddressesExhausted(_))
        ));
    }
}
