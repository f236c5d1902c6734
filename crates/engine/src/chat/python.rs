//! Python behaviour the chat templates expect: transformers' `tojson` (json.dumps),
//! `repr(float)`, and `strftime_now`.

use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Error, ErrorKind, Value};

/// Python `json.dumps(value, ensure_ascii=False, indent=indent)`, as transformers
/// registers it. minijinja's built-in escapes `<`, `>`, `&`, `'`, which would change prompts.
pub(super) fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match (v.as_str(), i64::try_from(v.clone())) {
            (Some(s), _) => Some(s.to_owned()),
            (None, Ok(n)) => Some(" ".repeat(usize::try_from(n).unwrap_or(0))),
            _ => return Err(invalid("tojson indent must be an integer or a string")),
        },
    };
    let mut json = JsonWriter {
        out: String::new(),
        indent,
        ensure_ascii: ensure_ascii.unwrap_or(false),
    };
    json.value(value, 0)?;
    Ok(Value::from_safe_string(json.out))
}

fn invalid(msg: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidOperation, msg.into())
}

struct JsonWriter {
    out: String,
    indent: Option<String>,
    ensure_ascii: bool,
}

impl JsonWriter {
    fn value(&mut self, v: &Value, level: usize) -> Result<(), Error> {
        match v.kind() {
            ValueKind::None => self.out.push_str("null"),
            ValueKind::Bool => self
                .out
                .push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number if v.is_integer() => {
                let _ = write!(self.out, "{v}");
            }
            ValueKind::Number => {
                let f = f64::try_from(v.clone())?;
                self.out.push_str(&py_float(f));
            }
            ValueKind::String => self.string(v.as_str().unwrap_or_default()),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = v.try_iter()?.collect();
                self.container('[', ']', &items, level, |w, item, lvl| w.value(item, lvl))?;
            }
            ValueKind::Map => {
                let keys: Vec<Value> = v.try_iter()?.collect();
                self.container('{', '}', &keys, level, |w, key, lvl| {
                    w.key(key)?;
                    w.out.push_str(": ");
                    w.value(&v.get_item(key)?, lvl)
                })?;
            }
            kind => {
                return Err(invalid(format!(
                    "Object of type {kind} is not JSON serializable"
                )));
            }
        }
        Ok(())
    }

    /// Python separators: ", " inline; "," plus newline and indent when indenting.
    fn container(
        &mut self,
        open: char,
        close: char,
        items: &[Value],
        level: usize,
        mut each: impl FnMut(&mut Self, &Value, usize) -> Result<(), Error>,
    ) -> Result<(), Error> {
        self.out.push(open);
        if !items.is_empty() {
            for (i, item) in items.iter().enumerate() {
                match &self.indent {
                    None if i > 0 => self.out.push_str(", "),
                    None => {}
                    Some(ind) => {
                        let ind = ind.repeat(level + 1);
                        self.out.push_str(if i > 0 { ",\n" } else { "\n" });
                        self.out.push_str(&ind);
                    }
                }
                each(self, item, level + 1)?;
            }
            if let Some(ind) = &self.indent {
                let ind = ind.repeat(level);
                self.out.push('\n');
                self.out.push_str(&ind);
            }
        }
        self.out.push(close);
        Ok(())
    }

    /// Python converts non-string keys: numbers, booleans and None become strings.
    fn key(&mut self, k: &Value) -> Result<(), Error> {
        match k.kind() {
            ValueKind::String => self.string(k.as_str().unwrap_or_default()),
            ValueKind::None | ValueKind::Bool | ValueKind::Number => {
                let mut scalar = JsonWriter {
                    out: String::new(),
                    indent: None,
                    ensure_ascii: false,
                };
                scalar.value(k, 0)?;
                self.string(&scalar.out);
            }
            kind => {
                return Err(invalid(format!(
                    "keys must be str, int, float, bool or None, not {kind}"
                )));
            }
        }
        Ok(())
    }

    fn string(&mut self, s: &str) {
        self.out.push('"');
        for c in s.chars() {
            match c {
                '"' => self.out.push_str("\\\""),
                '\\' => self.out.push_str("\\\\"),
                '\n' => self.out.push_str("\\n"),
                '\r' => self.out.push_str("\\r"),
                '\t' => self.out.push_str("\\t"),
                '\u{8}' => self.out.push_str("\\b"),
                '\u{c}' => self.out.push_str("\\f"),
                c if c < ' ' || (self.ensure_ascii && !(' '..='~').contains(&c)) => {
                    let mut units = [0u16; 2];
                    for u in c.encode_utf16(&mut units) {
                        let _ = write!(self.out, "\\u{u:04x}");
                    }
                }
                c => self.out.push(c),
            }
        }
        self.out.push('"');
    }
}

/// Python's `repr(float)`: shortest round-trip digits, exponent form outside 1e-4..1e16.
pub(super) fn py_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".to_owned();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.to_owned();
    }
    let sci = format!("{:e}", f.abs()); // e.g. "1.2345e-5", shortest digits
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let sign = if f.is_sign_negative() { "-" } else { "" };
    if !(-4..16).contains(&exp) {
        let (first, rest) = digits.split_at(1);
        let frac = if rest.is_empty() {
            String::new()
        } else {
            format!(".{rest}")
        };
        let esign = if exp < 0 { '-' } else { '+' };
        return format!("{sign}{first}{frac}e{esign}{:02}", exp.abs());
    }
    if exp < 0 {
        let zeros = "0".repeat((-exp - 1) as usize);
        return format!("{sign}0.{zeros}{digits}");
    }
    let int_len = exp as usize + 1;
    if digits.len() <= int_len {
        let pad = "0".repeat(int_len - digits.len());
        format!("{sign}{digits}{pad}.0")
    } else {
        let (int, frac) = digits.split_at(int_len);
        format!("{sign}{int}.{frac}")
    }
}

/// `strftime_now(format)` as transformers defines it, in UTC (no time-zone database).
pub(super) fn strftime_now(format: String) -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    strftime_utc(&format, secs)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const DAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// The common C strftime directives (`%-d` style unpadded too); others pass through.
fn strftime_utc(format: &str, unix_secs: i64) -> String {
    let days = unix_secs.div_euclid(86_400);
    let secs = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (secs / 3600, secs % 3600 / 60, secs % 60);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let yday = days - days_from_civil(year, 1, 1) + 1;
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };
    let month_name = MONTHS[(month - 1) as usize];

    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut spec = chars.next();
        let unpadded = spec == Some('-');
        if unpadded {
            spec = chars.next();
        }
        let num = |n: i64, width: usize| {
            if unpadded {
                n.to_string()
            } else {
                format!("{n:0width$}")
            }
        };
        let text = match spec {
            Some('Y') => year.to_string(),
            Some('y') => num(year.rem_euclid(100), 2),
            Some('m') => num(month, 2),
            Some('d') => num(day, 2),
            Some('e') => format!("{day:2}"),
            Some('H') => num(hour, 2),
            Some('I') => num(hour12, 2),
            Some('M') => num(minute, 2),
            Some('S') => num(second, 2),
            Some('j') => num(yday, 3),
            Some('p') => (if hour < 12 { "AM" } else { "PM" }).to_owned(),
            Some('B') => month_name.to_owned(),
            Some('b') | Some('h') => month_name[..3].to_owned(),
            Some('A') => DAYS[weekday].to_owned(),
            Some('a') => DAYS[weekday][..3].to_owned(),
            Some('%') => "%".to_owned(),
            Some(other) => format!("%{}{other}", if unpadded { "-" } else { "" }),
            None => "%".to_owned(),
        };
        out.push_str(&text);
    }
    out
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian (H. Hinnant).
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_float_repr() {
        let cases = [
            (1.0, "1.0"),
            (-0.0, "-0.0"),
            (0.5, "0.5"),
            (1e-4, "0.0001"),
            (1.5e-5, "1.5e-05"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (123456789012345678.0, "1.2345678901234568e+17"),
            (-2.5e-300, "-2.5e-300"),
            (0.1 + 0.2, "0.30000000000000004"),
        ];
        for (f, want) in cases {
            assert_eq!(py_float(f), want, "{f:e}");
        }
    }

    #[test]
    fn strftime_known_instant() {
        // 2024-02-29 13:05:09 UTC, a Thursday, day 60 of a leap year.
        let t = 1_709_211_909;
        let got = strftime_utc(
            "%Y-%m-%d %H:%M:%S|%d %b %Y|%A %a %B|%j|%I%p|%-d|%y|%%|%Q",
            t,
        );
        assert_eq!(
            got,
            "2024-02-29 13:05:09|29 Feb 2024|Thursday Thu February|060|01PM|29|24|%|%Q"
        );
        assert_eq!(strftime_utc("%Y-%m-%d %A", 0), "1970-01-01 Thursday");
        assert_eq!(strftime_utc("%Y-%m-%d", -86_400), "1969-12-31");
    }
}
