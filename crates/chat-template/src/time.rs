//! Python's `strftime`, for transformers' `strftime_now` (Llama 3.2's template writes
//! today's date into the system prompt).

/// Python's `strftime` of `time` for the directives chat templates use; an unknown
/// directive is written as it is (as Python leaves it).
pub fn strftime(format: &str, time: &jiff::Zoned) -> String {
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
    // The calendar is jiff's; the directives are written here, so that an unknown one
    // stays as Python leaves it (jiff's own formatter refuses it).
    let (year, month, day) = (time.year(), time.month(), time.day());
    let (hour, minute, second) = (time.hour(), time.minute(), time.second());
    let day_of_year = time.day_of_year();
    let month_name = MONTHS[usize::try_from(month - 1).unwrap_or(0)];
    let day_name = DAYS[usize::from(time.weekday().to_monday_zero_offset().unsigned_abs())];
    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let Some(d) = chars.next() else {
            out.push('%');
            break;
        };
        let piece = match d {
            'Y' => year.to_string(),
            'y' => format!("{:02}", year.rem_euclid(100)),
            'm' => format!("{month:02}"),
            'd' => format!("{day:02}"),
            'e' => format!("{day:>2}"),
            'j' => format!("{day_of_year:03}"),
            'H' => format!("{hour:02}"),
            'I' => format!("{:02}", (hour + 11) % 12 + 1),
            'p' => (if hour < 12 { "AM" } else { "PM" }).to_string(),
            'M' => format!("{minute:02}"),
            'S' => format!("{second:02}"),
            'B' => month_name.to_string(),
            'b' | 'h' => month_name[..3].to_string(),
            'A' => day_name.to_string(),
            'a' => day_name[..3].to_string(),
            '%' => "%".to_string(),
            other => format!("%{other}"),
        };
        out.push_str(&piece);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_writes_pythons_directives() {
        let at = |second: i64| {
            jiff::Timestamp::from_second(second)
                .expect("in range")
                .to_zoned(jiff::tz::TimeZone::UTC)
        };
        // 2024-07-23 14:05:09 UTC, a Tuesday.
        let t = at(1_721_743_509);
        assert_eq!(strftime("%d %b %Y", &t), "23 Jul 2024");
        assert_eq!(
            strftime("%A %B %e, %y %H:%M:%S %I%p %j %% %Q", &t),
            "Tuesday July 23, 24 14:05:09 02PM 205 % %Q"
        );
        assert_eq!(strftime("%Y-%m-%d %a", &at(0)), "1970-01-01 Thu");
    }
}
