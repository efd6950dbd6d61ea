//! Reading a results file's keys and rendering its numbers the way the
//! READMEs write them, and the one-line caption from a file's stamp.

use serde_json::Value;

use super::Error;

/// The value at a dotted path (`sizes.0.per_client.p50_ms`: object keys and
/// array indices).
pub fn at<'a>(v: &'a Value, path: &str) -> Result<&'a Value, Error> {
    let mut cur = v;
    for key in path.split('.') {
        let next = match cur {
            Value::Object(map) => map.get(key),
            Value::Array(items) => key.parse::<usize>().ok().and_then(|i| items.get(i)),
            _ => None,
        };
        cur = next.ok_or_else(|| Error::Missing {
            key: path.to_string(),
        })?;
    }
    Ok(cur)
}

pub fn num(v: &Value, path: &str) -> Result<f64, Error> {
    at(v, path)?.as_f64().ok_or_else(|| Error::NotA {
        key: path.to_string(),
        kind: "number",
    })
}

pub fn text<'a>(v: &'a Value, path: &str) -> Result<&'a str, Error> {
    at(v, path)?.as_str().ok_or_else(|| Error::NotA {
        key: path.to_string(),
        kind: "string",
    })
}

pub fn list<'a>(v: &'a Value, path: &str) -> Result<&'a [Value], Error> {
    at(v, path)?
        .as_array()
        .map(Vec::as_slice)
        .ok_or_else(|| Error::NotA {
            key: path.to_string(),
            kind: "array",
        })
}

/// Rounded to an integer, with thousands separators: `1,348`.
pub fn int(x: f64) -> String {
    let s = plain(x);
    let (sign, digits) = s.strip_prefix('-').map_or(("", s.as_str()), |d| ("-", d));
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    format!("{sign}{out}")
}

/// Rounded to an integer, no separators: `1348`.
pub fn plain(x: f64) -> String {
    format!("{x:.0}")
}

/// `decimals` places: `dec(1.75, 1)` is `1.8`.
pub fn dec(x: f64, decimals: usize) -> String {
    format!("{x:.decimals$}")
}

/// Three significant digits, at most two decimals: `0.66`, `6.81`, `47.1`,
/// `144`.
pub fn sig3(x: f64) -> String {
    let a = x.abs();
    if a >= 100.0 {
        dec(x, 0)
    } else if a >= 10.0 {
        dec(x, 1)
    } else {
        dec(x, 2)
    }
}

/// A number as written without a unit's fixed places: `0`, `2`, `2.5`.
pub fn short(x: f64) -> String {
    if x.fract() == 0.0 {
        plain(x)
    } else {
        let s = dec(x, 3);
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

/// The load average's one-minute figure from `/proc/loadavg`'s line.
fn one_minute(load: &str) -> Option<&str> {
    load.split_whitespace().next()
}

/// Load average before and after, whichever way the file records it: the
/// stamp's `machine_before`/`machine_after`, or the older `machine.before`,
/// `machine.load_average_before`, `machine.load_average`.
fn load_average(v: &Value) -> Option<String> {
    let s = |p: &str| at(v, p).ok().and_then(Value::as_str).and_then(one_minute);
    let pair = [
        ("machine_before.load_average", "machine_after.load_average"),
        ("machine.before.load_average", "machine.after.load_average"),
        ("machine.load_average_before", "machine.load_average_after"),
    ]
    .iter()
    .find_map(|(b, a)| Some((s(b)?, s(a)?)));
    match pair {
        Some((b, a)) => Some(format!("load average {b} → {a}")),
        None => s("machine.load_average").map(|l| format!("load average {l}")),
    }
}

fn cores(v: &Value) -> Option<u64> {
    [
        "machine_before.cores",
        "machine.before.cores",
        "machine.cores",
    ]
    .iter()
    .find_map(|p| at(v, p).ok().and_then(Value::as_u64))
}

/// What one file's stamp says: `commit edce1c0 (dirty), 2026-11-27 15:25
/// UTC, 2 cores, load average 6.07 → 24.48`; "no commit recorded" without
/// one.
pub fn stamp(v: &Value) -> String {
    let mut parts = Vec::new();
    match at(v, "commit").ok().and_then(Value::as_str) {
        Some(c) => {
            let short = c.get(..7).unwrap_or(c);
            let dirty = at(v, "dirty").ok().and_then(Value::as_bool) == Some(true);
            parts.push(format!(
                "commit {short}{}",
                if dirty { " (dirty)" } else { "" }
            ));
        }
        None => parts.push("no commit recorded".to_string()),
    }
    if let Some(date) = at(v, "date").ok().and_then(Value::as_str) {
        // RFC 3339 to the minute: `2026-11-27T15:25:00Z` → `2026-11-27 15:25 UTC`.
        let day = date.get(..10).unwrap_or(date);
        match date.get(11..16) {
            Some(time) if date.ends_with('Z') => parts.push(format!("{day} {time} UTC")),
            _ => parts.push(date.to_string()),
        }
    }
    if let Some(n) = cores(v) {
        parts.push(format!("{n} cores"));
    }
    if let Some(l) = load_average(v) {
        parts.push(l);
    }
    parts.join(", ")
}

/// The caption line over a table: each file and its stamp.
pub fn caption(files: &[&str], values: &[Value]) -> String {
    let each: Vec<String> = files
        .iter()
        .zip(values)
        .map(|(f, v)| format!("`{f}`: {}", stamp(v)))
        .collect();
    format!("_From {}._", each.join("; "))
}

/// A Markdown table: the header, the separator, the rows.
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    // An empty cell is `| |`, as the READMEs write it.
    let line = |cells: &[String]| {
        let mut out = String::from("|");
        for c in cells {
            out.push_str(if c.is_empty() { " |" } else { " " });
            if !c.is_empty() {
                out.push_str(c);
                out.push_str(" |");
            }
        }
        out
    };
    let mut out = vec![
        line(&header.iter().map(|h| h.to_string()).collect::<Vec<_>>()),
        line(&vec!["---".to_string(); header.len()]),
    ];
    out.extend(rows.iter().map(|r| line(r)));
    out.join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn numbers_render_as_the_readmes_write_them() {
        assert_eq!(int(1347.6), "1,348");
        assert_eq!(int(999.4), "999");
        assert_eq!(int(1_234_567.0), "1,234,567");
        assert_eq!(plain(1331.78), "1332");
        assert_eq!(dec(1.75, 1), "1.8");
        assert_eq!(sig3(0.661709), "0.66");
        assert_eq!(sig3(47.081), "47.1");
        assert_eq!(sig3(144.4), "144");
        assert_eq!(short(0.0), "0");
        assert_eq!(short(2.5), "2.5");
    }

    #[test]
    fn the_stamp_reads_every_shape_of_machine_and_tolerates_none() {
        let new = json!({"commit": "edce1c0ba0906089", "dirty": true, "date": "2026-11-27T15:25:00Z",
            "machine_before": {"cores": 2, "load_average": "6.07 8.65 8.79 8/283 22814"},
            "machine_after": {"cores": 2, "load_average": "24.48 13.60 10.50 16/1482 10590"}});
        assert_eq!(
            stamp(&new),
            "commit edce1c0 (dirty), 2026-11-27 15:25 UTC, 2 cores, load average 6.07 → 24.48"
        );
        let old = json!({"commit": "d68afc5500", "dirty": false,
            "machine": {"cores": 2, "load_average_before": "11.45 1 1", "load_average_after": "11.02 1 1"}});
        assert_eq!(
            stamp(&old),
            "commit d68afc5, 2 cores, load average 11.45 → 11.02"
        );
        let single = json!({"machine": {"load_average": "5.22 7.92"}});
        assert_eq!(stamp(&single), "no commit recorded, load average 5.22");
        assert_eq!(
            stamp(&json!({"machine": "2 cores, one node"})),
            "no commit recorded"
        );
    }

    #[test]
    fn a_table_writes_empty_cells_as_the_readmes_do() {
        let t = table(&["a", "b"], &[vec!["1".to_string(), String::new()]]);
        assert_eq!(t, "| a | b |\n| --- | --- |\n| 1 | |");
    }

    #[test]
    fn a_missing_or_mistyped_key_is_an_error_naming_it() {
        let v = json!({"a": [{"b": 1}], "s": "x"});
        assert_eq!(num(&v, "a.0.b").unwrap(), 1.0);
        assert!(matches!(num(&v, "a.1.b"), Err(Error::Missing { key }) if key == "a.1.b"));
        assert!(matches!(
            num(&v, "s"),
            Err(Error::NotA { kind: "number", .. })
        ));
    }
}
