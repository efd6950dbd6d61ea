//! Static-mode listener specs: the agent's `--inbound`/`--outbound` and the
//! pod annotations `remora.dev/inbound`/`remora.dev/outbound` that the
//! injector turns into them.

use std::str::FromStr;

use serde::Serialize;

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
    }
}
