//! Syntax checks the API server applies to names inside a NetworkPolicy: label keys and
//! values, port names (IANA service names) and CIDRs.

use ipnet::IpNet;

fn is_dns1123_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

fn is_dns1123_subdomain(s: &str) -> bool {
    !s.is_empty() && s.len() <= 253 && s.split('.').all(is_dns1123_label)
}

/// `[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?`, at most 63 characters.
fn is_label_name_part(s: &str) -> bool {
    let alnum = |c: char| c.is_ascii_alphanumeric();
    !s.is_empty()
        && s.len() <= 63
        && s.starts_with(alnum)
        && s.ends_with(alnum)
        && s.chars().all(|c| alnum(c) || matches!(c, '-' | '_' | '.'))
}

/// Why `key` is not a valid label key (`[prefix/]name`), if it is not.
pub fn label_key_problem(key: &str) -> Option<String> {
    let (prefix, name) = match key.split_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    if prefix.is_some_and(|p| !is_dns1123_subdomain(p)) {
        return Some(format!(
            "invalid label key {key:?}: prefix must be a DNS subdomain"
        ));
    }
    if !is_label_name_part(name) {
        return Some(format!(
            "invalid label key {key:?}: name part must be at most 63 alphanumeric characters, '-', '_' or '.', starting and ending with an alphanumeric"
        ));
    }
    None
}

/// Why `value` is not a valid label value, if it is not (empty is valid).
pub fn label_value_problem(value: &str) -> Option<String> {
    (!value.is_empty() && !is_label_name_part(value)).then(|| {
        format!("invalid label value {value:?}: must be empty or at most 63 alphanumeric characters, '-', '_' or '.', starting and ending with an alphanumeric")
    })
}

/// Why `name` is not a valid port name (IANA_SVC_NAME), if it is not.
pub fn port_name_problem(name: &str) -> Option<String> {
    let ok = !name.is_empty()
        && name.len() <= 15
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && name.bytes().any(|b| b.is_ascii_lowercase())
        && !name.starts_with('-')
        && !name.ends_with('-')
        && !name.contains("--");
    (!ok).then(|| {
        format!("invalid port name {name:?}: must be at most 15 lowercase alphanumeric characters or '-', with at least one letter, no leading, trailing or double '-'")
    })
}

/// Parses a CIDR as the API server does; host bits are allowed and cleared.
pub fn parse_cidr(text: &str) -> Result<IpNet, CidrError> {
    text.parse::<IpNet>()
        .map(|net| net.trunc())
        .map_err(|source| CidrError {
            text: text.to_owned(),
            source,
        })
}

/// A CIDR that does not parse.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid CIDR {text:?}")]
pub struct CidrError {
    pub text: String,
    #[source]
    source: ipnet::AddrParseError,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_keys() {
        for ok in ["app", "kubernetes.io/metadata.name", "a.b-c_d", "x/y"] {
            assert_eq!(label_key_problem(ok), None, "{ok}");
        }
        for bad in ["", "-a", "a-", "Bad_/x", "/x", "a/", &"k".repeat(64)] {
            assert!(label_key_problem(bad).is_some(), "{bad}");
        }
    }

    #[test]
    fn label_values() {
        for ok in ["", "a", "A.b-c_9"] {
            assert_eq!(label_value_problem(ok), None, "{ok}");
        }
        for bad in ["-a", "a b", &"v".repeat(64)] {
            assert!(label_value_problem(bad).is_some(), "{bad}");
        }
    }

    #[test]
    fn port_names() {
        for ok in ["http", "serve-80-tcp", "a1"] {
            assert_eq!(port_name_problem(ok), None, "{ok}");
        }
        for bad in ["", "80", "Http", "-a", "a-", "a--b", "abcdefghijklmnop"] {
            assert!(port_name_problem(bad).is_some(), "{bad}");
        }
    }

    #[test]
    fn cidrs() {
        assert_eq!(parse_cidr("10.1.2.3/8").unwrap().to_string(), "10.0.0.0/8");
        assert_eq!(parse_cidr("fd00::1/64").unwrap().to_string(), "fd00::/64");
        assert!(parse_cidr("10.0.0.0").is_err());
        assert!(parse_cidr("10.0.0.0/33").is_err());
        assert!(parse_cidr("banana").is_err());
    }
}
