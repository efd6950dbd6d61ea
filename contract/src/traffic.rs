//! Static-mode listener specs: the agent's `--inbound`/`--outbound`/
//! `--outbound-tls` and the pod annotations `remora.dev/inbound`/
//! `remora.dev/outbound`/`remora.dev/outbound-tls` that the operator turns
//! into them.

use std::str::FromStr;

use serde::Serialize;

/// The most entries one `remora.dev/inbound` or `remora.dev/outbound`
/// annotation may list: each is an Envoy listener (and, inbound, a container
/// port), and a pod needs a handful; more is refused, not truncated.
pub const MAX_LISTENERS: usize = 32;

fn port(p: &str) -> Result<u16, String> {
    p.parse::<u16>()
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| format!("{:?} is not a port (1-65535)", crate::mode::short(p)))
}

/// `PORT:APP_PORT`, or just `APP_PORT` on the default inbound port.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct InboundSpec {
    /// Listener port; `None` means the default inbound port.
    pub port: Option<u16>,
    pub app_port: u16,
}

impl FromStr for InboundSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.split_once(':') {
            Some((l, a)) => Ok(Self {
                port: Some(port(l)?),
                app_port: port(a)?,
            }),
            None => Ok(Self {
                port: None,
                app_port: port(s)?,
            }),
        }
    }
}

/// `PORT:HOST:PORT`: a local listener forwarding to an upstream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct OutboundSpec {
    pub port: u16,
    pub host: String,
    pub upstream_port: u16,
}

impl FromStr for OutboundSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let shape = || format!("{:?} is not PORT:HOST:PORT", crate::mode::short(s));
        let (listen, rest) = s.split_once(':').ok_or_else(shape)?;
        let (host, up) = rest.rsplit_once(':').ok_or_else(shape)?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() {
            return Err(format!("{:?} has an empty host", crate::mode::short(s)));
        }
        Ok(Self {
            port: port(listen)?,
            host: host.to_string(),
            upstream_port: port(up)?,
        })
    }
}

impl OutboundSpec {
    /// Whether the upstream is this pod itself (loopback or the unspecified
    /// address): then its port must not be one of the sidecar's.
    pub fn targets_this_pod(&self) -> bool {
        let h = self.host.to_ascii_lowercase();
        if h == "localhost" || h.ends_with(".localhost") {
            return true;
        }
        h.parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback() || ip.is_unspecified())
    }
}

/// A SPIFFE ID as the spec allows it: `spiffe://` and a trust domain of
/// lowercase letters, digits, `.`, `-`, `_`, then an optional path of
/// non-empty segments (letters, digits, `.`, `-`, `_`; never `.` or `..`).
/// Checked where it is written, so a typo is not a peer nobody can match.
pub fn check_spiffe_id(s: &str) -> Result<(), String> {
    let bad = |why: &str| format!("{:?} is not a SPIFFE ID ({why})", crate::mode::short(s));
    let rest = s
        .strip_prefix("spiffe://")
        .ok_or_else(|| bad("it must start with spiffe://"))?;
    let (domain, path) = rest.split_once('/').unwrap_or((rest, ""));
    let domain_ok = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || ".-_".contains(c);
    if domain.is_empty() || !domain.chars().all(domain_ok) {
        return Err(bad(
            "the trust domain must be lowercase letters, digits, '.', '-' or '_'",
        ));
    }
    if rest.len() > domain.len() {
        let seg_ok = |c: char| c.is_ascii_alphanumeric() || ".-_".contains(c);
        if path
            .split('/')
            .any(|g| g.is_empty() || g == "." || g == ".." || !g.chars().all(seg_ok))
        {
            return Err(bad(
                "path segments must be non-empty letters, digits, '.', '-' or '_'",
            ));
        }
    }
    Ok(())
}

/// `PORT=SPIFFE_ID`: the outbound listener on PORT originates mTLS and
/// accepts only an upstream presenting that identity (the agent's
/// `--outbound-tls`, the annotation `remora.dev/outbound-tls`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct OutboundTlsSpec {
    pub port: u16,
    pub spiffe_id: String,
}

impl FromStr for OutboundTlsSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let (p, id) = s
            .split_once('=')
            .ok_or_else(|| format!("{:?} is not PORT=SPIFFE_ID", crate::mode::short(s)))?;
        let id = id.trim();
        check_spiffe_id(id)?;
        Ok(Self {
            port: port(p.trim())?,
            spiffe_id: id.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs() {
        assert_eq!(
            "15006:8080".parse::<InboundSpec>(),
            Ok(InboundSpec {
                port: Some(15006),
                app_port: 8080
            })
        );
        assert_eq!(
            "8080".parse::<InboundSpec>(),
            Ok(InboundSpec {
                port: None,
                app_port: 8080
            })
        );
        assert!("x:80".parse::<InboundSpec>().is_err());
        assert!("0".parse::<InboundSpec>().is_err());
        assert_eq!(
            "15001:api.local:443".parse::<OutboundSpec>(),
            Ok(OutboundSpec {
                port: 15001,
                host: "api.local".into(),
                upstream_port: 443
            })
        );
        assert_eq!(
            "15001:[::1]:80".parse::<OutboundSpec>().map(|o| o.host),
            Ok("::1".into())
        );
        assert!("15001:80".parse::<OutboundSpec>().is_err());
        assert!("15001::80".parse::<OutboundSpec>().is_err());
        let local = |s: &str| s.parse::<OutboundSpec>().map(|o| o.targets_this_pod());
        assert_eq!(local("1:127.0.0.2:80"), Ok(true));
        assert_eq!(local("1:[::1]:80"), Ok(true));
        assert_eq!(local("1:0.0.0.0:80"), Ok(true));
        assert_eq!(local("1:LocalHost:80"), Ok(true));
        assert_eq!(local("1:api.local:80"), Ok(false));
        assert_eq!(local("1:10.0.0.1:80"), Ok(false));
    }

    #[test]
    fn outbound_tls_specs() {
        assert_eq!(
            "15001=spiffe://cluster.local/ns/shop/sa/api".parse::<OutboundTlsSpec>(),
            Ok(OutboundTlsSpec {
                port: 15001,
                spiffe_id: "spiffe://cluster.local/ns/shop/sa/api".into()
            })
        );
        assert_eq!(
            " 9000 = spiffe://td "
                .parse::<OutboundTlsSpec>()
                .map(|s| s.port),
            Ok(9000)
        );
        for bad in [
            "15001",
            "15001:spiffe://td/x",
            "x=spiffe://td/x",
            "0=spiffe://td/x",
            "15001=http://td/x",
            "15001=spiffe://",
            "15001=spiffe://TD/x",
            "15001=spiffe://td//x",
            "15001=spiffe://td/x/",
            "15001=spiffe://td/../x",
            "15001=spiffe://td/a b",
        ] {
            assert!(bad.parse::<OutboundTlsSpec>().is_err(), "{bad}");
        }
        assert_eq!(check_spiffe_id("spiffe://cluster.local"), Ok(()));
    }
}
